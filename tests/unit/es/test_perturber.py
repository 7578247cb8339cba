import math

import pytest
import torch

from esopt_mp.es import Perturber, build_local_shards, local_noise, member_seed
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.es.ulp import ulp_drift, ulp_of


def _model(dtype=torch.float32, seed=0, width=(48, 64, 32)):
    torch.manual_seed(seed)
    a, b, c = width
    m = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU(), torch.nn.Linear(b, c))
    return m.to(dtype)


# Noise costs per block of elements, whatever the tensor: the many-cycle and chunking tests take 536 elements
# (tensors of 384, 16, 128 and 8: one shorter than a block of 13), not 5216.
SMALL = (24, 16, 8)


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_snapshot_restore_is_bit_exact_over_1000_cycles_bf16():
    m = _model(torch.bfloat16, width=SMALL)
    before = _state(m)
    p = Perturber(build_local_shards(m), restore="snapshot")
    for i in range(1000):
        p.perturb(member_seed(3, 0, i), 1e-2, sign=1 if i % 2 else -1)
        assert not torch.equal(m[0].weight, before["0.weight"])
        p.restore()
    for k, v in _state(m).items():
        assert torch.equal(v, before[k]), k


def test_subtract_restore_drifts_in_bf16_and_is_tiny_in_fp32():
    drifts = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(dtype, width=SMALL)
        before = _state(m)
        p = Perturber(build_local_shards(m), restore="subtract")
        for i in range(200):
            p.perturb(member_seed(3, 0, i), 1e-3)
            p.restore()
        drifts[dtype] = max((v.float() - before[k].float()).abs().max().item() for k, v in _state(m).items())
        assert max(ulp_drift(v, before[k])[0] for k, v in _state(m).items()) >= 1, dtype
    assert drifts[torch.float32] < 1e-6  # rounding noise only
    assert drifts[torch.bfloat16] > 100 * drifts[torch.float32]


def test_update_matches_dense_formula_and_chunking_is_bitwise_neutral():
    seeds = [member_seed(11, 2, i) for i in range(5)]
    signs = [1, -1, 1, -1, 1]
    weights = [0.3, -1.2, 0.0, 2.0, -0.7]
    alpha, wd = 0.05, 0.01
    results = []
    for chunk in (7, 100, 1 << 24):  # under a block, blocks within a tensor, whole tensors
        m = _model(width=SMALL)
        base = _state(m)
        Perturber(build_local_shards(m), chunk_elems=chunk, block=13).update(seeds, signs, weights, alpha, wd)
        results.append(_state(m))
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]) and torch.equal(results[0][k], results[2][k])
        eps = sum(w * s * local_noise(sd, ShardInfo.full(k, base[k].shape)).double()
                  for sd, s, w in zip(seeds, signs, weights))
        expected = (1 - alpha * wd) * base[k].double() + alpha / len(seeds) * eps
        assert torch.allclose(results[0][k].double(), expected, atol=1e-6), k


def test_row_sharded_perturbers_equal_the_whole():
    w = torch.randn(10, 12)
    whole = w.clone()
    halves = [w[:4].clone(), w[4:].clone()]
    p_whole = Perturber([LocalShard(whole, ShardInfo.full("w", (10, 12)))], restore="subtract")
    p_parts = [Perturber([LocalShard(h, ShardInfo("w", (10, 12), (a, 0), tuple(h.shape)))], restore="subtract")
               for h, a in zip(halves, (0, 4))]
    seeds = [member_seed(1, 0, i) for i in range(3)]
    for p in [p_whole, *p_parts]:
        p.perturb(seeds[0], 0.1)
    assert torch.equal(torch.cat(halves), whole)
    for p in [p_whole, *p_parts]:
        p.restore()
        p.update(seeds, [1, 1, -1], [1.0, -0.5, 0.25], 0.1)
    assert torch.equal(torch.cat(halves), whole)


def test_fp32_host_master_absorbs_small_bf16_updates():
    torch.manual_seed(0)
    # |w| <= 0.02: bf16 spacing <= 1.2e-4, far above each 1e-5 step, far below their 1e-3 sum
    base = ((torch.rand(256, 256) * 2 - 1) * 0.02).bfloat16()
    info = ShardInfo.full("w", (256, 256))
    eps = local_noise(42, info).double()
    expected = 100 * 1e-5 * eps  # 100 updates, each alpha * eps with alpha = 1e-5

    def moved(master: str) -> float:
        w = base.clone()
        p = Perturber([LocalShard(w, info)], master=master)
        for _ in range(100):
            p.update([42], [1], [1.0], 1e-5)
        delta = w.double() - base.double()
        return float((delta * expected).sum() / (expected * expected).sum())

    assert abs(moved("fp32_host") - 1) < 0.01
    assert moved("none") < 0.5  # plain bf16 rounds most 1e-5 steps away


def test_master_restore_is_exact_and_tracks_updates():
    m = _model(torch.bfloat16)
    p = Perturber(build_local_shards(m), master="fp32_host")
    p.update([5, 6], [1, 1], [1.0, -1.0], 1e-2)
    after_update = _state(m)
    for i in range(20):
        p.perturb(i, 0.05)
        p.restore()
    for k, v in _state(m).items():
        assert torch.equal(v, after_update[k])


def test_snapshot_refreshes_after_update():
    w = torch.zeros(64)
    p = Perturber([LocalShard(w, ShardInfo.full("w", (64,)))], restore="snapshot")
    p.perturb(1, 1.0)
    p.restore()
    p.update([2], [1], [1.0], 1.0)
    updated = w.clone()
    p.perturb(3, 1.0)
    p.restore()
    assert torch.equal(w, updated) and w.abs().sum() > 0


def test_guards_and_bad_input():
    w = torch.zeros(8)
    shard = LocalShard(w, ShardInfo.full("w", (8,)))
    p = Perturber([shard])
    with pytest.raises(RuntimeError, match="no active"):
        p.restore()
    p.perturb(1, 0.1)
    with pytest.raises(RuntimeError, match="active"):
        p.perturb(2, 0.1)
    with pytest.raises(RuntimeError, match="perturbed"):
        p.update([1], [1], [1.0], 0.1)
    p.restore()
    for bad in (-1.0, math.nan, math.inf, "x"):
        with pytest.raises(ValueError, match="sigma"):
            p.perturb(1, bad)
    assert not p.is_perturbed
    with pytest.raises(ValueError, match="sign"):
        p.perturb(1, 0.1, sign=0)
    with pytest.raises(ValueError, match="equal length"):
        p.update([1, 2], [1, 1], [1.0], 0.1)
    with pytest.raises(ValueError, match="alpha"):
        p.update([1], [1], [1.0], math.inf)
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        p.update([1, 2], [1, 1], [1.0, math.nan], 0.1)
    with pytest.raises(ValueError, match="es.restore: must be one of"):
        Perturber([shard], restore="undo")
    with pytest.raises(ValueError, match="es.master: must be one of"):
        Perturber([shard], master="fp64")
    with pytest.raises(ValueError, match="only once"):
        Perturber([shard, shard])
    with pytest.raises(ValueError, match="floating"):
        LocalShard(torch.zeros(8, dtype=torch.int64), ShardInfo.full("i", (8,)))
    with pytest.raises(ValueError, match="shape"):
        LocalShard(torch.zeros(9), ShardInfo.full("w", (8,)))
    assert torch.equal(w, torch.zeros(8))


def test_ulp_helpers():
    x = torch.tensor([1.0, 2.0, 0.75], dtype=torch.bfloat16)
    assert torch.equal(ulp_of(x), torch.tensor([2**-7, 2**-6, 2**-8], dtype=torch.float64))
    y = torch.tensor([1.0 + 2**-7, 2.0, 0.75 - 2 * 2**-8], dtype=torch.bfloat16)
    mx, rms = ulp_drift(y, x)
    assert mx == 2.0 and rms == pytest.approx((5 / 3) ** 0.5)
