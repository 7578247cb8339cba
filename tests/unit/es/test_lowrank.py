"""es.noise=lowrank: each 2-D tensor perturbed by A B^T / sqrt(r) from the member's seed, the same bits whatever the
sharding or the chunking; other tensors left alone (decay aside)."""
import math

import pytest
import torch

from esopt_mp.es import Perturber, build_local_shards, local_noise, member_seed
from esopt_mp.es import lowrank
from esopt_mp.es.shard import LocalShard, ShardInfo

SEEDS = [member_seed(5, 1, i) for i in range(4)]
SIGNS = [1, -1, 1, -1]
WEIGHTS = [0.7, -1.1, 0.0, 1.9]


def _dense_e(seed: int, name: str, shape, rank: int) -> torch.Tensor:
    """E = A B^T / sqrt(r) of the whole tensor in float64, from the factors' own canonical noise."""
    m, n = shape
    a = local_noise(seed, ShardInfo.full(name + lowrank.A_SUFFIX, (m, rank))).double()
    b = local_noise(seed, ShardInfo.full(name + lowrank.B_SUFFIX, (n, rank))).double()
    return a @ b.T / math.sqrt(rank)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("rank", [1, 3])
def test_perturbation_is_the_rank_r_product_and_restores_exactly(rank):
    m = _model()
    base = _state(m)
    p = Perturber(build_local_shards(m), noise="lowrank", rank=rank)
    assert p.kinds == ["lowrank", "none", "lowrank", "none"]
    sigma = 0.01
    p.perturb(SEEDS[0], sigma, -1)
    for k, v in _state(m).items():
        if v.dim() == 1:  # biases are not perturbed in this mode
            assert torch.equal(v, base[k]), k
            continue
        e = _dense_e(SEEDS[0], k, v.shape, rank)
        # each element: a sum of r fp32 products and one fp32 add onto the weight: a few ulps of its size
        tol = 4 * (rank + 1) * 2.0**-24 * (base[k].abs().double() + sigma * e.abs() + sigma)
        assert ((v.double() - (base[k].double() - sigma * e)).abs() <= tol).all(), k
        # rank r up to the fp32 rounding of the add (singular values ~1e-7 against sigma * sqrt(m n) ~ 0.1 for E)
        assert torch.linalg.matrix_rank(v.double() - base[k].double(), atol=1e-5) == rank
    p.restore()
    assert all(torch.equal(v, base[k]) for k, v in _state(m).items())


def test_shards_regenerate_their_rows_of_a_and_b_bit_for_bit():
    """Column-parallel (rows of W) and row-parallel (columns of W) shards against the whole tensor: perturb and
    update, in chunks of odd sizes."""
    torch.manual_seed(1)
    w = torch.randn(10, 12)
    whole = w.clone()
    rows = [w[:4].clone(), w[4:].clone()]
    cols = [w[:, :5].clone().contiguous(), w[:, 5:].clone().contiguous()]
    ps = [Perturber([LocalShard(whole, ShardInfo.full("w", (10, 12)))], noise="lowrank", rank=2, chunk_elems=1 << 20)]
    ps += [Perturber([LocalShard(h, ShardInfo("w", (10, 12), (a, 0), tuple(h.shape)))], noise="lowrank", rank=2,
                     chunk_elems=chunk) for h, a, chunk in zip(rows, (0, 4), (13, 24))]
    ps += [Perturber([LocalShard(h, ShardInfo("w", (10, 12), (0, a), tuple(h.shape)))], noise="lowrank", rank=2,
                     chunk_elems=chunk) for h, a, chunk in zip(cols, (0, 5), (1, 7))]
    for p in ps:
        p.perturb(SEEDS[1], 0.1, -1)
    assert torch.equal(torch.cat(rows), whole) and torch.equal(torch.cat(cols, 1), whole)
    for p in ps:
        p.restore()
        p.update(SEEDS, SIGNS, WEIGHTS, 0.1, weight_decay=0.5)
    assert torch.equal(torch.cat(rows), whole) and torch.equal(torch.cat(cols, 1), whole)
    assert not torch.equal(whole, w)


def test_update_matches_the_dense_formula_and_chunking_is_bitwise_neutral():
    alpha, wd, rank = 0.05, 0.01, 2
    results = []
    for chunk in (1, 40, 1 << 24):  # one row at a time (a row is wider than the chunk), a few rows, whole tensors
        m = _model()
        base = _state(m)
        Perturber(build_local_shards(m), noise="lowrank", rank=rank, chunk_elems=chunk).update(
            SEEDS, SIGNS, WEIGHTS, alpha, wd)
        results.append(_state(m))
    for k, v in results[0].items():
        assert all(torch.equal(v, r[k]) for r in results[1:]), k
        if v.dim() == 1:  # not perturbed: the decay alone
            assert torch.equal(v, base[k] * (1 - alpha * wd)) or torch.allclose(v, base[k] * (1 - alpha * wd),
                                                                               rtol=2.0**-23, atol=0), k
            continue
        step = sum(w * s * _dense_e(sd, k, v.shape, rank) for sd, s, w in zip(SEEDS, SIGNS, WEIGHTS))
        expected = (1 - alpha * wd) * base[k].double() + alpha / len(SEEDS) * step
        assert torch.allclose(v.double(), expected, atol=1e-6, rtol=0), k


def test_without_decay_other_tensors_never_change():
    m = _model()
    base = _state(m)
    Perturber(build_local_shards(m), noise="lowrank").update(SEEDS, SIGNS, WEIGHTS, 0.1)
    after = _state(m)
    assert torch.equal(after["0.bias"], base["0.bias"]) and torch.equal(after["2.bias"], base["2.bias"])
    assert not torch.equal(after["0.weight"], base["0.weight"])


def test_full_mode_is_untouched_by_the_new_arguments():
    a, b = _model(), _model()
    Perturber(build_local_shards(a)).update(SEEDS, SIGNS, WEIGHTS, 0.1)
    Perturber(build_local_shards(b), noise="full", rank=7).update(SEEDS, SIGNS, WEIGHTS, 0.1)
    assert all(torch.equal(v, _state(b)[k]) for k, v in _state(a).items())


def test_factor_boxes_and_bad_input():
    info = ShardInfo("w", (10, 12), (4, 0), (6, 12))
    fa, fb = lowrank.factor_infos(info, 3)
    assert (fa.global_shape, fa.offset, fa.local_shape) == ((10, 3), (4, 0), (6, 3))
    assert (fb.global_shape, fb.offset, fb.local_shape) == ((12, 3), (0, 0), (12, 3))
    with pytest.raises(ValueError, match="2-D"):
        lowrank.factor_infos(ShardInfo.full("b", (5,)), 1)
    shards = build_local_shards(_model())
    with pytest.raises(ValueError, match="es.noise"):
        Perturber(shards, noise="sparse")
    for bad in (0, 65, 1.5):
        with pytest.raises(ValueError, match="es.rank"):
            Perturber(shards, noise="lowrank", rank=bad)


def test_one_call_per_member_gives_each_shards_factors_bit_for_bit():
    """The bank's slices of one kernel call equal each factor generated alone, for whole tensors and for row and
    column boxes whose factor ranges start off a counter boundary (offsets x r not a multiple of 4)."""
    infos = [ShardInfo.full("a", (10, 12)), ShardInfo("w", (10, 12), (3, 0), (7, 12)),
             ShardInfo("w", (10, 12), (0, 5), (10, 7)), ShardInfo("v", (9, 1), (1, 0), (5, 1))]
    for rank in (1, 3):
        bank = lowrank.FactorBank(infos, rank, "cpu")
        for seed in SEEDS[:2]:
            for info, (a, b) in zip(infos, bank.factors(seed)):
                want_a, want_b = lowrank.factors(seed, info, rank)
                assert torch.equal(a, want_a) and torch.equal(b, want_b), (info, rank)
