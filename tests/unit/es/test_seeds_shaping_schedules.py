import math

import numpy as np
import pytest

from esopt_mp.es import Schedule, member_seed, population, shape_returns, splitmix64


def test_splitmix64_known_answer():
    # first output of SplitMix64 seeded with 0 (Vigna's reference implementation)
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_member_seeds_are_distinct_and_deterministic():
    seeds = {member_seed(r, s, m) for r in range(3) for s in range(20) for m in range(32)}
    assert len(seeds) == 3 * 20 * 32
    assert member_seed(7, 3, 1) == member_seed(7, 3, 1)
    assert all(0 <= x < 2**64 for x in seeds)
    with pytest.raises(ValueError, match="step"):
        member_seed(1, -1, 0)


def test_population_mirrored_pairs():
    seeds, signs = population(5, 2, 6, mirrored=True)
    assert signs == [1, -1, 1, -1, 1, -1]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]
    plain, psigns = population(5, 2, 6)
    assert len(set(plain)) == 6 and psigns == [1] * 6
    with pytest.raises(ValueError, match="even"):
        population(5, 2, 5, mirrored=True)
    with pytest.raises(ValueError, match=">= 1"):
        population(5, 2, 0)


def test_zscore_population_std_and_nan_members():
    r = [1.0, 0.0, 1.0, 1.0]
    w = shape_returns(r)
    mu, sd = np.mean(r), np.std(r)
    assert np.allclose(w, (np.array(r) - mu) / (sd + 1e-8))
    w = shape_returns([1.0, math.nan, 0.0, math.inf])
    assert w[1] == 0 and w[3] == 0
    assert np.allclose(w[[0, 2]], [1.0, -1.0], atol=1e-7)
    assert np.all(shape_returns([math.nan, math.nan]) == 0)
    assert np.all(shape_returns([0.5, 0.5, 0.5]) == 0)  # no signal, no step


def test_centered_rank_and_raw():
    w = shape_returns([3.0, 1.0, 2.0, 2.0, math.nan], "centered_rank")
    assert np.allclose(w, [0.5, -0.5, 0.0, 0.0, 0.0])
    assert np.allclose(shape_returns([2.0, -1.0], "raw"), [2.0, -1.0])
    with pytest.raises(ValueError, match="shaping"):
        shape_returns([1.0], "softmax")
    with pytest.raises(ValueError, match="non-empty"):
        shape_returns([])


def test_schedules():
    cos = Schedule("cosine", 1e-3, 2.5e-4, 100)
    assert cos(0) == pytest.approx(1e-3) and cos(100) == pytest.approx(2.5e-4)
    assert cos(50) == pytest.approx((1e-3 + 2.5e-4) / 2)
    assert cos(1000) == pytest.approx(2.5e-4)
    assert all(cos(t) >= cos(t + 1) for t in range(100))
    assert Schedule("cosine", 1e-3, 0.0, 10)(10) == 0.0
    assert Schedule("linear", 1.0, 0.0, 4)(1) == pytest.approx(0.75)
    assert Schedule("constant", 1.5e-3, 0.0, 70)(33) == 1.5e-3
    with pytest.raises(ValueError, match="kind"):
        Schedule("step")
    with pytest.raises(ValueError, match="start"):
        Schedule("cosine", -1.0)
    with pytest.raises(ValueError, match="end"):
        Schedule("cosine", 1.0, math.nan)
    with pytest.raises(ValueError, match="steps"):
        Schedule("cosine", 1.0, 0.0, 0)
