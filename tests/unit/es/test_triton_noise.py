"""The Triton noise kernels against the torch reference, bit for bit, under Triton's interpreter.

TRITON_INTERPRET=1 (set for each test here) lets the kernels run on CPU tensors, in Triton's
interpreter; test_cuda_* repeats the equalities with compiled kernels on a GPU, in a fresh process
(tools/bench_noise.py --cuda --check-only).
"""
import logging
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install 'esopt_mp[triton]')")

from esopt_mp.es.config import ESConfig  # noqa: E402
from esopt_mp.es import Perturber, local_noise, member_seed, stream  # noqa: E402
from esopt_mp.es.shard import LocalShard, ShardInfo  # noqa: E402
from esopt_mp.es import backend, triton_noise  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")

SEED = (1 << 63) + 987654321987654321  # above 2**63: the int64 bit pattern path
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (global shape, box): whole, row shard, column shard, uneven rows / columns, a 3-d box, a vector slice
BOXES = {
    "whole": ((37, 53), None),
    "rows": ((30, 50), (slice(10, 20), slice(0, 50))),
    "cols": ((30, 50), (slice(0, 30), slice(25, 50))),
    "uneven_rows": ((30, 50), (slice(7, 8), slice(0, 50))),
    "uneven_cols": ((30, 50), (slice(0, 30), slice(3, 34))),
    "box3d": ((4, 6, 10), (slice(1, 3), slice(2, 5), slice(3, 9))),
    "vector": ((101,), (slice(33, 90),)),
    # runs starting at multiples of 4: the kernels' four-elements-per-counter (QUAD) tiles
    "whole4": ((32, 48), None),
    "rows4": ((32, 48), (slice(8, 16), slice(0, 48))),
    "cols4": ((32, 48), (slice(0, 32), slice(8, 24))),
    "box3d4": ((4, 8, 12), (slice(1, 3), slice(2, 5), slice(4, 12))),
}
QUAD = {"rows", "whole4", "rows4", "cols4", "box3d4"}


def _info(kind, name="model.layers.3.mlp.down_proj.weight"):
    shape, box = BOXES[kind]
    if box is None:
        return ShardInfo.full(name, shape)
    return ShardInfo(name, shape, tuple(s.start for s in box), tuple(s.stop - s.start for s in box))


def _weights(info, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(info.local_shape, generator=g) * 0.05).to(dtype)


@pytest.mark.parametrize("kind", list(BOXES))
def test_noise_equals_reference_on_every_slice(kind):
    info = _info(kind)
    assert triton_noise._quad_aligned(triton_noise._geometry(info), 0) == (kind in QUAD)  # both kernel paths
    ref = local_noise(SEED, info)
    for block in (100, 102):  # blocks that cut runs; starts at multiples of 4 (QUAD) or not
        got = local_noise(SEED, info, backend="triton", block=block)
        assert torch.equal(got, ref)
    full = local_noise(SEED, ShardInfo.full(info.name, info.global_shape))
    box = BOXES[kind][1]
    assert torch.equal(got, full if box is None else full[box])  # the slice of the canonical eps


def test_noise_equals_reference_on_65536_elements_and_counter_high_word():
    info = ShardInfo.full("model.embed_tokens.weight", (1 << 16,))
    assert torch.equal(local_noise(7, info, backend="triton"), local_noise(7, info))
    far = ShardInfo("big", (3, 1 << 33), (1, (1 << 33) - 700), (2, 600))  # j // 4 above 2**32
    assert torch.equal(local_noise(SEED, far, backend="triton"), local_noise(SEED, far))


def test_every_backend_gives_the_same_noise():
    """Eager, auto and Triton (interpreted) here; the compiled backend, whose compiler starts processes, in
    tests/integration/test_triton_compile.py."""
    info = _info("uneven_cols")
    ref = local_noise(SEED, info, backend="eager")
    for name in ("auto", "triton"):
        assert torch.equal(local_noise(SEED, info, backend=name), ref), name


def _run(backend_name, infos, dtype, master, restore, members, alpha, wd):
    ts = [_weights(i, dtype, k) for k, i in enumerate(infos)]
    p = Perturber([LocalShard(t, i) for t, i in zip(ts, infos)], restore=restore, master=master,
                  noise_backend=backend_name, chunk_elems=700)
    out = {}
    p.perturb(member_seed(1, 2, 3), 0.02, sign=-1)
    out["perturbed"] = [t.clone() for t in ts]
    p.restore()
    out["restored"] = [t.clone() for t in ts]
    seeds = [s for s, _ in members]
    p.update(seeds, [1 if k % 2 == 0 else -1 for k in range(len(seeds))], [w for _, w in members], alpha, wd)
    out["updated"] = [t.clone() for t in ts]
    out["master"] = [m.clone() for m in p.master_host.tensors] if p.master_host else []
    return out


def _members(g):
    return [(member_seed(11, 4, k), 0.75 - 0.1 * k if k % 5 else 0.0) for k in range(g)]  # zero weights skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 8, 32])
def test_perturb_restore_update_equal_eager(dtype, g):
    infos = [_info(k, f"model.{k}.weight") for k in ("whole", "cols", "uneven_rows", "box3d", "cols4", "whole4")]
    cases = (("none", "subtract", 0.0), ("none", "snapshot", 0.01), ("fp32_host", "snapshot", 0.01))
    for master, restore, wd in cases if g < 32 else (("none", "subtract", 0.01),):  # the interpreter is slow
        a = _run("eager", infos, dtype, master, restore, _members(g), 0.3, wd)
        b = _run("triton", infos, dtype, master, restore, _members(g), 0.3, wd)
        for key in a:
            for x, y in zip(a[key], b[key]):
                assert torch.equal(x, y), (key, master, restore, wd)


def test_bf16_writes_round_fp32_result_to_nearest_even_once():
    info = ShardInfo.full("w", (4096,))
    w = _weights(info, torch.bfloat16)
    eps = local_noise(SEED, info)
    scale = 0.01
    exact32 = torch.addcmul(w.float(), eps, torch.tensor(scale, dtype=torch.float32))  # fp32 fma, rounded once
    rne = exact32.bfloat16()  # torch: round to nearest, ties to even
    got = w.clone()
    triton_noise.axpy_(got.view(-1), SEED, info, scale)
    assert torch.equal(got, rne)
    trunc = (exact32.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()  # what truncation would give
    assert (rne != trunc).any()  # so the test can tell the two rules apart
    # ties to even, carry into the exponent, overflow to inf, NaN: an fp32 master holding these values
    # written to bf16 weights by the fused update (zero member weights: w = rne(master))
    vals = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2.0 - 2**-9, 3.4e38, float("nan")])
    expect = torch.tensor([1.0, 1.0 + 2**-6, -1.0, 2.0, float("inf"), float("nan")], dtype=torch.bfloat16)
    w = torch.zeros(6, dtype=torch.bfloat16)
    p = Perturber([LocalShard(w, ShardInfo.full("ties", (6,)))], master="fp32_host", noise_backend="triton")
    p.load_state_([vals])
    w.zero_()
    p.update([SEED], [1], [0.0], 0.1)
    assert torch.equal(w[:5], expect[:5]) and torch.isnan(w[5])
    assert torch.equal(w[:5], vals[:5].bfloat16())  # the same rule as torch's own conversion


def test_update_into_same_device_master_is_one_pass_and_equal():
    info = _info("cols4")
    for dtype in (torch.float32, torch.bfloat16):
        a = _run("eager", [info], dtype, "fp32_host", "snapshot", _members(8), 1e-4, 0.0)
        b = _run("triton", [info], dtype, "fp32_host", "snapshot", _members(8), 1e-4, 0.0)
        assert torch.equal(a["master"][0], b["master"][0]) and torch.equal(a["updated"][0], b["updated"][0])


def test_acc_only_chunk_equals_torch_accumulation():
    """The host-master path on CUDA: the kernel writes scale * sum for a chunk [a, b) of the shard."""
    for kind, (a, b) in (("uneven_cols", (333, 900)), ("cols4", (64, 500))):  # of 930 / 512 local elements
        _acc_only_case(_info(kind), a, b)


def _acc_only_case(info, a, b):
    members = _members(8)
    acc = torch.zeros(b - a)
    for seed, w in members:
        for p, z in stream(seed, info, a, b, block=256):
            acc[p - a : p - a + z.numel()].view_as(z).add_(z, alpha=w)
    acc.mul_(0.3 / 8)
    got = torch.full((b - a,), float("nan"))
    triton_noise.update_(got, info, members, 0.3 / 8, 1.0, start=a, acc_only=True)
    assert torch.equal(got, acc)


def test_fp64_weights_fall_back_to_torch_math_with_triton_noise():
    info = _info("rows")
    a = _run("eager", [info], torch.float64, "none", "subtract", _members(3), 0.2, 0.0)
    b = _run("triton", [info], torch.float64, "none", "subtract", _members(3), 0.2, 0.0)
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def test_several_small_fp64_tensors_with_triton_noise_are_not_grouped_and_match_eager():
    infos = [ShardInfo.full(f"small{k}", (8,)) for k in range(3)]  # small whole tensors: grouped under eager only
    a = _run("eager", infos, torch.float64, "none", "subtract", _members(3), 0.2, 0.0)
    b = _run("triton", infos, torch.float64, "none", "subtract", _members(3), 0.2, 0.0)
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def test_triton_backend_errors_name_the_config_key(monkeypatch):
    shard = LocalShard(torch.zeros(8), ShardInfo.full("w", (8,)))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match=r"es\.noise_backend=triton runs on CUDA tensors.*TRITON_INTERPRET=1"):
        Perturber([shard], noise_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    six = ShardInfo("t6", (2,) * 6, (0,) * 5 + (1,), (2,) * 5 + (1,))  # 5 outer dims around a 1-element run
    with pytest.raises(ValueError, match=r"es\.noise_backend=triton indexes at most 4 dims"):
        triton_noise.axpy_(torch.zeros(32), 1, six, None)
    monkeypatch.setattr(triton_noise, "triton", None)
    with pytest.raises(RuntimeError, match=r"es\.noise_backend=triton needs the triton package"):
        Perturber([shard], noise_backend="triton")
    with pytest.raises(ValueError, match=r"es\.noise_backend: must be one of"):
        Perturber([shard], noise_backend="cuda")
    with pytest.raises(ValueError, match="es.noise_backend"):
        ESConfig(noise_backend="fast").validate()


def test_auto_picks_by_device_and_size_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_logged", set())
    caplog.set_level(logging.INFO, logger="esopt_mp.es.backend")
    assert backend.resolve("auto", "cpu", 1000) == "eager"
    assert backend.resolve("auto", "cpu", 2000) == "eager"
    assert backend.resolve("auto", "cpu", backend.AUTO_COMPILE_MIN_ELEMS) == "compile"
    monkeypatch.setattr(backend, "_triton_works", lambda dev: (True, ""))  # no GPU here: the probe's verdict
    assert backend.resolve("auto", "cuda", 10) == "triton"
    monkeypatch.setattr(backend, "_triton_works", lambda dev: (False, "RuntimeError: Failed to find C compiler"))
    assert backend.resolve("auto", "cuda", 10) == "eager"  # imports, cannot build: falls back, says why
    assert any("Triton imports but fails here (RuntimeError: Failed to find C compiler)" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    caplog.clear()
    monkeypatch.setattr(backend, "triton_importable", lambda: False)
    monkeypatch.setattr(backend, "_logged", set())
    assert backend.resolve("auto", "cuda", 10) == "eager"
    assert backend.resolve("auto", "cpu", 10) == "eager"
    monkeypatch.setenv("ESOPT_NOISE_BACKEND", "compile")  # the environment overrides the config
    assert backend.resolve("auto", "cpu", 10) == "compile"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and sum("-> eager on cpu" in m for m in lines) == 1, lines
    monkeypatch.delenv("ESOPT_NOISE_BACKEND")
    assert ESConfig().noise_backend == "auto"
    assert Perturber([LocalShard(torch.zeros(8), ShardInfo.full("w", (8,)))]).backends == {torch.device("cpu"): "eager"}


def test_the_auto_probe_runs_the_kernel_against_the_reference(monkeypatch):
    """The probe auto runs once per CUDA device, here on CPU under the interpreter: a real launch, compared."""
    monkeypatch.setattr(backend, "_probed", {})
    assert backend._triton_works(torch.device("cpu")) == (True, "")
    monkeypatch.setattr(backend, "_probed", {})
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors without the interpreter: the launch refuses -> not used
    ok, why = backend._triton_works(torch.device("cpu"))
    assert not ok and "RuntimeError: es.noise_backend=triton runs on CUDA tensors" in why
