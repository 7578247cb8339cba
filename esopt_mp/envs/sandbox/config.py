"""The sandbox's limits, its config section (``env.sandbox``) and its result type."""
from __future__ import annotations

import dataclasses

from esopt_mp.envs.base import InfraError

LEVELS = ("bwrap", "unshare", "rlimit")  # strongest first


class SandboxUnavailable(RuntimeError):
    """No isolation level at or above the configured minimum works here."""


class SandboxStartError(InfraError):
    """A call's sandbox could not be started (the interpreter, a fork, the namespace tool): not the code's doing,
    so the episode is an infrastructure failure, not a failed answer."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    nproc: int = 32  # processes/threads of this one call (not of the user)
    fsize_mb: int = 16  # one file
    total_mb: int = 256  # everything one call may write (scratch and /tmp together)
    nofile: int = 64  # open files; also bounds deleted-but-open files to nofile * fsize_mb
    output_bytes: int = 64 * 1024


@dataclasses.dataclass
class SandboxConfig:
    """``env.sandbox``: the isolation floor and limit overrides (``None``: the environment's own default)."""

    level: str = "auto"  # auto: the strongest that works here
    min_level: str = "rlimit"  # refuse to start below this level
    wall_s: float | None = None
    cpu_s: int | None = None
    memory_mb: int | None = None
    nproc: int | None = None
    fsize_mb: int | None = None
    total_mb: int | None = None
    nofile: int | None = None
    output_bytes: int | None = None

    def validate(self, key: str = "env.sandbox") -> None:
        if self.level not in ("auto",) + LEVELS:
            raise ValueError(f"{key}.level: must be auto or one of {LEVELS}, got {self.level!r}")
        if self.min_level not in LEVELS:
            raise ValueError(f"{key}.min_level: must be one of {LEVELS}, got {self.min_level!r}")
        if self.level != "auto" and LEVELS.index(self.level) > LEVELS.index(self.min_level):
            raise ValueError(f"{key}.level: {self.level!r} is weaker than {key}.min_level={self.min_level!r}")
        for f in dataclasses.fields(SandboxLimits):
            v = getattr(self, f.name)
            if v is not None and not v > 0:
                raise ValueError(f"{key}.{f.name}: must be > 0, got {v}")

    def limits(self, defaults: SandboxLimits | None = None) -> SandboxLimits:
        over = {f.name: getattr(self, f.name) for f in dataclasses.fields(SandboxLimits)}
        return dataclasses.replace(defaults or SandboxLimits(), **{k: v for k, v in over.items() if v is not None})


@dataclasses.dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    error: str | None = None  # timeout / output or byte cap / killed by signal / nonzero exit / setup failure

    @property
    def ok(self) -> bool:
        return self.error is None
