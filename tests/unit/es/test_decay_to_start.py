"""es.decay_to: weight decay toward zero (the default, unchanged) or toward the run's starting weights theta0.

The update with decay_to=start is theta <- theta + (step - alpha*wd * (theta - theta0)), the bracket in fp32: each
test rebuilds it from the noise with the same operations and compares bit for bit. The whole runs (resume from a
checkpoint, replay from the ledger) are in tests/integration/test_decay_to_start_run.py.
"""
import pytest
import torch

from esopt_mp.es import Perturber, build_local_shards, local_noise, member_seed
from esopt_mp.es.config import ESConfig
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.typed import ConfigError

SEEDS = [member_seed(5, 1, i) for i in range(4)]
SIGNS = [1, -1, 1, -1]
WEIGHTS = [0.7, -1.1, 0.0, 1.9]  # a zero weight: that member is skipped, as in the update
ALPHA, WD = 0.05, 3.0  # alpha*wd = 0.15: a pull far above rounding


def _step(info: ShardInfo) -> torch.Tensor:
    """The update's fp32 step (alpha/G) * sum_i w_i sign_i eps_i, summed as the Perturber sums it."""
    acc = torch.zeros(info.local_shape, dtype=torch.float32)
    for seed, sign, w in zip(SEEDS, SIGNS, WEIGHTS):
        if w != 0.0:
            acc.add_(local_noise(seed, info), alpha=sign * w)
    return acc.mul_(ALPHA / len(SEEDS))


def _expected(theta: torch.Tensor, theta0: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """theta + (step - alpha*wd * (theta - theta0)) in fp32, rounded once into theta's dtype."""
    acc = _step(info).add_(theta.float() - theta0.float(), alpha=-ALPHA * WD)
    return acc.add_(theta.float()).to(theta.dtype)


def _shard(dtype, shape=(24, 40), seed=0, name="layer.weight"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.1).to(dtype)
    return w, ShardInfo.full(name, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 100, 1 << 24])  # under a block, blocks within the tensor, the whole tensor
def test_update_rule_is_the_exact_formula(dtype, chunk):
    w, info = _shard(dtype)
    theta0 = (w.float() + 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    before = w.clone()
    p = Perturber([LocalShard(w, info)], chunk_elems=chunk, block=13, decay_to="start")
    p.set_start_([theta0])  # a start that differs from the current weights
    p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD)
    want = _expected(before, theta0, info)
    assert torch.equal(w, want)
    # and the formula itself, in float64: within the rounding of one fp32 step plus the final rounding
    exact = (before.double() - ALPHA * WD * (before.double() - theta0.double()) + _step(info).double())
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8
    assert torch.allclose(w.double(), exact, rtol=ulp, atol=1e-7)


def test_small_tensors_grouped_into_one_noise_call_take_the_same_rule():
    """Small whole tensors get their noise in groups (one kernel call per group and seed): each still takes exactly
    the formula, as alone."""
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    shards = build_local_shards(m)
    before = [s.tensor.clone() for s in shards]
    theta0 = [b + 0.05 * torch.randn_like(b) for b in before]
    p = Perturber(shards, decay_to="start")
    assert p._wholes and len(p._in_whole) == len(shards)  # the grouped path
    p.set_start_(theta0)
    p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD)
    for s, b, t0 in zip(shards, before, theta0):
        assert torch.equal(s.tensor, _expected(b, t0, s.info)), s.info.name


def test_fp32_master_decays_toward_the_exact_start():
    """es.master=fp32_host: the master takes the update, theta0 is the bf16 start (the master's exact start), the
    weights are the master rounded to bf16."""
    w, info = _shard(torch.bfloat16, seed=2)
    start = w.clone()
    p = Perturber([LocalShard(w, info)], master="fp32_host", decay_to="start")
    assert p.has_start and p.host_bytes == p.master_host.nbytes + p.start_host.nbytes
    assert p.start_host.nbytes == p.master_host.nbytes // 2  # theta0 in the shard's dtype: half the fp32 master
    p.update(SEEDS[:2], SIGNS[:2], [1.0, 1.0], 0.2, 0.0)  # move the master away from the start first
    m = p.master_host.tensors[0].clone()
    assert not torch.equal(m, start.float())
    p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD)
    want = _step(info).add_(m - start.float(), alpha=-ALPHA * WD).add_(m)
    assert torch.equal(p.master_host.tensors[0], want)
    assert torch.equal(w, want.to(torch.bfloat16))


def _pure_decay(p: Perturber, alpha=0.1, wd=2.0):
    """An update whose step is zero (every shaped weight 0): only the decay acts."""
    p.update(SEEDS[:2], SIGNS[:2], [0.0, 0.0], alpha, wd)


def test_start_pulls_toward_theta0_not_zero_and_survives_a_state_load():
    """decay_to=start keeps the weights as the Perturber found them; a later load_state_ (a checkpoint restored on
    resume) moves the weights, not theta0."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))
    base = {k: v.detach().clone() for k, v in m.state_dict().items()}
    p = Perturber(build_local_shards(m), decay_to="start")
    delta = [torch.randn_like(s.tensor) * 0.3 for s in p.shards]
    p.load_state_([s.tensor + d for s, d in zip(p.shards, delta)])  # as a checkpoint restore would
    moved = {k: v.detach().clone() for k, v in m.state_dict().items()}
    _pure_decay(p)  # alpha*wd = 0.2: theta - theta0 shrinks by 0.8, theta0 stays put
    for k, v in m.state_dict().items():
        assert torch.allclose(v - base[k], 0.8 * (moved[k] - base[k]), atol=1e-6), k
        assert not torch.allclose(v, 0.8 * moved[k], atol=1e-3), k  # not the pull toward zero
    for _ in range(60):
        _pure_decay(p)
    for k, v in m.state_dict().items():
        assert torch.allclose(v, base[k], atol=1e-5), k  # converged onto the start, not onto zero

    torch.manual_seed(0)
    z = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6))
    q = Perturber(build_local_shards(z))  # the default: toward zero
    q.load_state_([s.tensor + d for s, d in zip(q.shards, delta)])
    _pure_decay(q)
    for k, v in z.state_dict().items():
        assert torch.allclose(v, 0.8 * moved[k], atol=1e-6), k


def test_the_default_is_unchanged():
    """No decay_to, decay_to=zero and decay_to=start with no decay give the same bits; the default keeps no start
    copy and applies the dense formula (1 - alpha*wd) theta + step."""
    results = []
    for kw, wd in (({}, WD), ({"decay_to": "zero"}, WD)):
        w, info = _shard(torch.float32, seed=3)
        before = w.clone()
        p = Perturber([LocalShard(w, info)], **kw)
        assert not p.has_start and p.start_host is None and p.decay_to == "zero"
        p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, wd)
        results.append(w)
        exact = (1 - ALPHA * wd) * before.double() + _step(info).double()
        assert torch.allclose(w.double(), exact, atol=1e-7)
    assert torch.equal(results[0], results[1])
    plain = []
    for kw in ({}, {"decay_to": "start"}):  # no decay: the start changes nothing
        w, info = _shard(torch.bfloat16, seed=4)
        Perturber([LocalShard(w, info)], **kw).update(SEEDS, SIGNS, WEIGHTS, ALPHA, 0.0)
        plain.append(w)
    assert torch.equal(plain[0], plain[1])


def test_an_explicit_rule_overrides_and_a_missing_start_is_refused():
    w, info = _shard(torch.float32, seed=5)
    p = Perturber([LocalShard(w, info)])
    with pytest.raises(RuntimeError, match="needs the run's starting weights"):
        p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD, decay_to="start")
    with pytest.raises(ValueError, match="es.decay_to"):
        p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD, decay_to="origin")
    with pytest.raises(ValueError, match="es.decay_to"):
        Perturber([LocalShard(w, info)], decay_to="origin")
    with pytest.raises(ValueError, match="start of shape"):
        p.set_start_([torch.zeros(3)])
    p.set_start_()  # the current weights
    before = w.clone()
    p.update(SEEDS, SIGNS, WEIGHTS, ALPHA, WD, decay_to="start")
    assert torch.equal(w, _expected(before, before, info))
    p.perturb(SEEDS[0], 0.1)
    with pytest.raises(RuntimeError, match="perturbed"):
        p.set_start_()


def test_config_validates_and_hashes_decay_to():
    from esopt_mp.config import build_config
    from esopt_mp.identity import config_identity

    ESConfig(decay_to="start").validate()
    with pytest.raises(ConfigError, match="es.decay_to"):
        ESConfig(decay_to="origin").validate()
    default = config_identity(build_config({}, 1))
    zero = config_identity(build_config({"es": {"decay_to": "zero"}}, 1))
    start = config_identity(build_config({"es": {"decay_to": "start"}}, 1))
    assert default["hash"] == zero["hash"] and "es.decay_to" not in default["fields"]  # runs before it keep theirs
    assert start["hash"] != default["hash"] and start["fields"]["es.decay_to"] == "start"
