"""What a step is, as a pure function of (run seed, step), identical on every rank: its members' seeds and signs,
every random stream derived from the run seed, and the step sizes sigma_t and alpha_t (their schedules)."""
from __future__ import annotations

import dataclasses
import math

from esopt_mp.lazy import moved_names
from esopt_mp.typed import check, check_choice

M64 = (1 << 64) - 1
__getattr__ = moved_names(__name__, {"Member": "esopt_mp.core.types"})  # kept one release


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


def stream_seed(run_seed: int, stream: str, *path: int) -> int:
    """Every random stream of a run, derived in one place.

    - ``member`` (step, member): the perturbation seed (see :func:`member_seed`);
      identical on every rank, TP and DP alike: each TP rank regenerates its own
      slice of the same eps, each DP group regenerates all seeds for the update.
    - ``tasks`` (step,): which tasks the step's episodes play; drawn by every TP
      leader and identical across DP groups, so all members of a step meet the
      same tasks (common random numbers).
    - ``episode`` (step, member, episode): the token sampling seed of one
      episode; shared by the TP ranks of the group that plays it (they sample
      identical tokens from identical gathered logits), distinct across members
      and episodes, independent of batch composition.
    - ``common_episode`` (step, episode): with ``env.common_draws``, the token sampling seed of episode ``episode``
      of the step for every member alike (common random numbers in the sampling too: two members' returns then
      differ by their perturbations, not by their luck in the draws).
    - ``eval`` (question, sample): sampling seeds of held-out evaluation (Mean@k / Pass@k); the same at
      every evaluation of a run and across a resume (common random numbers: before/after comparable).
    - ``skill`` (step, batch): the sampling seed of a skill proposal (prompt.optimiser=skill).
    - ``skill_val`` (step,) which tasks validate a candidate skill; (step, i + 1) episode i's sampling seed: the
      current and the candidate skill meet the same tasks and seeds.
    - ``context`` (step, slot): how a prompt optimiser renders the context of a training episode (EoH: its
      parents); slot = step + pair * episodes + episode, so both members of a mirrored pair get the same
      context, and the same at every TP / DP layout.
    - ``conversation`` (j,) from an episode's seed: the sampling seed of the j-th conversation (j >= 1) a served
      member's episode opens on the endpoint (the first samples with the episode seed itself).
    """
    tags = {"member": 0, "tasks": 1, "episode": 2, "eval": 3, "skill": 4, "skill_val": 5, "context": 6,
            "conversation": 7, "common_episode": 8}
    if stream not in tags:
        raise ValueError(f"unknown random stream {stream!r}; known: {sorted(tags)}")
    if stream == "member":
        return member_seed(run_seed, *path)
    x = splitmix64(int(run_seed) ^ (tags[stream] << 56))
    for v in path:
        if not 0 <= int(v) <= M64:
            raise ValueError(f"stream path values must be in [0, 2**64), got {v}")
        x = splitmix64(x ^ int(v))
    return x


KINDS = ("cosine", "constant", "linear")


def check_schedule(kind: str, start: float, end: float, steps: int | None, key: str = "schedule") -> None:
    """The one check of a schedule's settings (``es.sigma`` / ``es.alpha`` and :class:`Schedule` alike)."""
    check_choice(kind, KINDS, f"{key}.kind")
    for k, v in (("start", start), ("end", end)):
        check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, f"{key}.{k}",
              f"must be finite and >= 0, got {v!r}")
    check(steps is None or steps >= 1, f"{key}.steps", f"must be >= 1, got {steps}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``value(t)`` for t in [0, steps]; t beyond ``steps`` holds the end value.

    cosine: ``end + (start - end) * (1 + cos(pi * t / steps)) / 2`` (the paper's
    sigma schedule; train-time ``end > 0``, test-time ``end = 0``).
    """

    kind: str = "cosine"
    start: float = 1e-3
    end: float = 0.0
    steps: int = 100

    def __post_init__(self):
        check_schedule(self.kind, self.start, self.end, self.steps)

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"step must be >= 0, got {t}")
        x = min(t, self.steps) / self.steps
        if self.kind == "constant":
            return float(self.start)
        if self.kind == "linear":
            return self.start + (self.end - self.start) * x
        return self.end + (self.start - self.end) * (1.0 + math.cos(math.pi * x)) / 2.0
