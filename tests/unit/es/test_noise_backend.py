"""es.noise_backend=auto on CPU decides on the run's noise work, not on the shard's size."""
import pytest

from esopt_mp.config import build_config
from esopt_mp.es import backend, philox
from esopt_mp.trainer import noise_passes


def test_compiling_repays_over_a_runs_work_not_over_a_short_test_run():
    # the embedded default: 40 steps x 32 passes x 494k elements: repaid from a warm kernel cache, not from an empty one
    assert backend.compile_repays(6e8, warm=True)[0] and not backend.compile_repays(6e8, warm=False)[0]
    assert backend.compile_repays(2e9, warm=False)[0]  # a longer run repays even the first compile
    assert not backend.compile_repays(6e6, warm=True)[0]  # a 2-step test run
    assert "an empty kernel cache" in backend.compile_repays(1e8, warm=False)[1]


def test_auto_takes_the_work_when_given(monkeypatch):
    monkeypatch.delenv("ESOPT_NOISE_BACKEND", raising=False)
    monkeypatch.setattr(philox, "kernel_cached", lambda: True)
    assert backend.resolve("auto", "cpu", 494_000, work=6e8) == "compile"
    monkeypatch.setattr(philox, "kernel_cached", lambda: False)
    assert backend.resolve("auto", "cpu", 494_000, work=6e8) == "eager"
    assert backend.resolve("auto", "cpu", 494_000, work=494_000 * 16) == "eager"
    assert backend.resolve("auto", "cpu", 1 << 24) == "compile"  # no estimate: the shard's size
    assert backend.resolve("eager", "cpu", 494_000, work=6e12) == "eager"  # a choice is kept


def test_noise_passes_count_what_each_rank_regenerates():
    cfg = build_config({"es": {"population": 16, "steps": 40}})
    assert noise_passes(cfg.es, 1) == 40 * (16 + 16)  # its members' perturbs, the update's sum
    assert noise_passes(cfg.es, 4) == 40 * (4 + 16)
    cfg.es.restore = "subtract"  # every member perturbed and restored on every rank, then the update
    assert noise_passes(cfg.es, 4) == 40 * 3 * 16


@pytest.mark.parametrize("env, want", [({"TORCHINDUCTOR_CACHE_DIR": "/k"}, "/k"),
                                       ({"XDG_CACHE_HOME": "/x"}, "/x/esopt_mp/inductor")])
def test_the_kernel_cache_dir(monkeypatch, env, want):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert philox.kernel_cache_dir() == want


def test_small_whole_tensors_get_their_noise_in_one_call_and_the_same_bits():
    """Perturb and update over many small whole tensors (grouped: one kernel call per seed) equal, bit for bit,
    the same operations tensor by tensor from the reference stream."""
    import torch

    from esopt_mp.es import Perturber, local_noise
    from esopt_mp.es.shard import LocalShard, ShardInfo

    torch.manual_seed(0)
    shapes = [(7,), (33, 5), (64, 64), (3, 3, 3), (1,), (130,), (40, 17)]
    def shards():
        g = torch.Generator().manual_seed(1)
        return [LocalShard(torch.randn(s, generator=g), ShardInfo.full(f"t{k}", s)) for k, s in enumerate(shapes)]

    mine = shards()
    p = Perturber(mine, restore="subtract", noise_backend="eager", block=1 << 14)
    assert p._wholes and sum(len(ks) for _, ks in p._wholes) == len(shapes)  # grouped
    ref = shards()
    p.perturb(99, 0.5, -1)
    for a, b in zip(mine, ref):
        want = b.tensor.clone().add_(local_noise(99, b.info).view(-1).view_as(b.tensor), alpha=-0.5)
        assert torch.equal(a.tensor, want), a.info.name
    p.restore()
    seeds, weights = [5, 6, 7], [0.25, -1.0, 0.5]
    before = [s.tensor.clone() for s in mine]
    p.update(seeds, [1, -1, 1], weights, 0.1)
    for s, w0 in zip(mine, before):
        acc = torch.zeros(s.info.numel)
        for seed, g, w in zip(seeds, [1, -1, 1], weights):
            acc.add_(local_noise(seed, s.info).view(-1), alpha=g * w)
        acc.mul_(0.1 / 3)
        assert torch.equal(s.tensor.view(-1), w0.view(-1).add_(acc)), s.info.name


def test_the_shard_descriptions_former_path_is_the_same_class():
    """``esopt_mp.parallel.shard`` (its former home) goes on naming the same classes, with a one-line notice."""
    import importlib
    import sys

    from esopt_mp.es import shard

    sys.modules.pop("esopt_mp.parallel.shard", None)
    with pytest.warns(DeprecationWarning, match=r"^esopt_mp.parallel.shard is now esopt_mp.es.shard"):
        old = importlib.import_module("esopt_mp.parallel.shard")

    assert old.ShardInfo is shard.ShardInfo and old.LocalShard is shard.LocalShard
