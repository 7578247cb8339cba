"""Run untrusted Python (agent tool calls, generated heuristics) in a separate, confined process.

The strongest isolation level that works here is chosen at start-up (see :mod:`.core` for what each level
confines) and logged; nothing runs below ``min_level`` (config ``env.sandbox.min_level``).
"""
from esopt_mp.envs.sandbox.config import (LEVELS, SandboxConfig, SandboxLimits, SandboxResult, SandboxStartError,
                                         SandboxUnavailable)
from esopt_mp.envs.sandbox.core import Sandbox, Session, probe

__all__ = ["LEVELS", "Sandbox", "SandboxConfig", "SandboxLimits", "SandboxResult", "SandboxStartError",
           "SandboxUnavailable", "Session", "probe"]
