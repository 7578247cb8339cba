"""Member seeds: a pure function of (run seed, step, member), identical on every rank."""
from __future__ import annotations

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al.), a strong 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def member_seed(run_seed: int, step: int, index: int) -> int:
    """64-bit seed of perturbation ``index`` at ``step``; no communication needed."""
    for name, v in (("run_seed", run_seed), ("step", step), ("index", index)):
        if not 0 <= int(v) <= M64:
            raise ValueError(f"{name} must be in [0, 2**64), got {v}")
    return splitmix64(splitmix64(splitmix64(int(run_seed)) ^ int(step)) ^ int(index))


def population(run_seed: int, step: int, size: int, mirrored: bool = False) -> tuple[list[int], list[int]]:
    """(seeds, signs) of the step's ``size`` members.

    With mirrored (antithetic) sampling members 2k and 2k+1 share the seed of
    pair k and take signs +1 / -1, so ``size`` must be even.
    """
    if size < 1:
        raise ValueError(f"population size must be >= 1, got {size}")
    if mirrored:
        if size % 2:
            raise ValueError(f"mirrored sampling needs an even population, got {size}")
        seeds = [member_seed(run_seed, step, m // 2) for m in range(size)]
        return seeds, [1 if m % 2 == 0 else -1 for m in range(size)]
    return [member_seed(run_seed, step, m) for m in range(size)], [1] * size
