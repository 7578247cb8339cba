import pytest
import torch

from esopt_mp.es.noise import fill_, gaussian, local_noise, stream
from esopt_mp.es.shard import ShardInfo

SEED = 987654321987654321
NAME = "model.layers.3.self_attn.o_proj.weight"


def _full(shape, seed=SEED, name=NAME, **kw):
    return local_noise(seed, ShardInfo.full(name, shape), **kw)


def _piece(shape, slices, seed=SEED, name=NAME, block=1 << 16):
    offset = tuple(s.start for s in slices)
    local = tuple(s.stop - s.start for s in slices)
    return local_noise(seed, ShardInfo(name, shape, offset, local), block=block)


def test_full_tensor_equals_gaussian_at_row_major_indices():
    shape = (37, 53)
    full = _full(shape)
    idx = torch.arange(37 * 53, dtype=torch.int64).view(shape)
    assert torch.equal(full, gaussian(SEED, NAME, idx))


@pytest.mark.parametrize("block", [1, 5, 64, 1000, 1 << 20])
def test_block_size_does_not_change_values(block):
    shape = (23, 41)
    assert torch.equal(_full(shape, block=block), _full(shape))


def test_row_column_and_uneven_slices_are_bit_identical():
    shape = (30, 50)
    full = _full(shape)
    rows = torch.cat([_piece(shape, (slice(a, a + 10), slice(0, 50))) for a in (0, 10, 20)], 0)
    cols = torch.cat([_piece(shape, (slice(0, 30), slice(a, a + 25)), block=77) for a in (0, 25)], 1)
    uneven_rows = torch.cat([_piece(shape, (slice(a, b), slice(0, 50))) for a, b in ((0, 7), (7, 8), (8, 30))], 0)
    uneven_cols = torch.cat([_piece(shape, (slice(0, 30), slice(a, b)), block=13) for a, b in ((0, 3), (3, 34), (34, 50))], 1)
    for got in (rows, cols, uneven_rows, uneven_cols):
        assert torch.equal(got, full)


def test_three_d_boxes_and_vectors():
    shape = (4, 6, 10)
    full = _full(shape)
    for box in [(slice(1, 3), slice(2, 5), slice(3, 9)), (slice(0, 4), slice(0, 6), slice(5, 10)), (slice(2, 3), slice(0, 6), slice(0, 10))]:
        assert torch.equal(_piece(shape, box, block=11), full[box])
    vec = _full((101,))
    assert torch.equal(_piece((101,), (slice(33, 90),), block=8), vec[33:90])
    scalar = _full(())
    assert scalar.shape == () and torch.equal(scalar, gaussian(SEED, NAME, torch.tensor(0)))


def test_stream_partial_ranges_cover_exactly():
    info = ShardInfo("w", (12, 20), (0, 7), (12, 9))
    whole = local_noise(SEED, info).view(-1)
    got = torch.full_like(whole, float("nan"))
    for a, b in ((0, 5), (5, 50), (50, 108)):
        for p, z in stream(SEED, info, a, b, block=10):
            assert a <= p and p + z.numel() <= b and z.numel() <= 10
            got[p : p + z.numel()] = z.reshape(-1)
    assert torch.equal(got, whole)


def test_fill_scale_and_accumulate():
    info = ShardInfo.full("w", (8, 8))
    eps = local_noise(SEED, info)
    out = torch.ones(8, 8)
    fill_(out, SEED, info, scale=0.5, accumulate=True)
    assert torch.allclose(out, 1 + 0.5 * eps)
    fill_(out, SEED, info, scale=-2.0)
    assert torch.equal(out, -2.0 * eps)


def test_statistics():
    n = 1 << 20
    a = _full((n,), name="a")
    b = _full((n,), name="b")
    c = _full((n,), seed=SEED + 1, name="a")
    assert abs(a.mean().item()) < 0.005 and abs(a.std().item() - 1) < 0.005
    assert abs((a.abs() < 1).float().mean().item() - 0.682689) < 0.003
    assert abs((a.abs() < 2).float().mean().item() - 0.954500) < 0.002

    def corr(x, y):
        x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
        return ((x * y).mean() / (x.std() * y.std())).item()

    assert abs(corr(a, b)) < 0.01, "tensors with different names must be independent"
    assert abs(corr(a, c)) < 0.01, "members with different seeds must be independent"
    for lag in (1, 2, 3, 4, 5):
        assert abs(corr(a[:-lag], a[lag:])) < 0.01, f"neighbouring indices correlated at lag {lag}"
    # the four lanes of one counter each have unit variance
    for lane in range(4):
        assert abs(a[lane::4].std().item() - 1) < 0.01


@pytest.mark.parametrize("offset,local", [((0, 5), (4, 6)), ((3, 0), (2, 11)), ((-1, 0), (2, 2))])
def test_slice_outside_global_shape(offset, local):
    with pytest.raises(ValueError, match="outside the global shape"):
        ShardInfo("w", (4, 10), offset, local)


def test_bad_shard_info_and_out():
    with pytest.raises(ValueError, match="rank"):
        ShardInfo("w", (4, 4), (0,), (4, 4))
    with pytest.raises(ValueError, match="name"):
        ShardInfo.full("", (3,))
    info = ShardInfo.full("w", (4, 4))
    with pytest.raises(ValueError, match="shape"):
        fill_(torch.zeros(4, 5), 1, info)
    with pytest.raises(ValueError, match="contiguous"):
        fill_(torch.zeros(4, 4).t(), 1, info)
    with pytest.raises(ValueError, match="outside"):
        list(stream(1, info, 3, 100))
