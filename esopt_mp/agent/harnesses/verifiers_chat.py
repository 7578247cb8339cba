"""verifiers' own chat program (its ``null`` harness) run on this interpreter: a harness for a verifiers taskset that
needs no download.

verifiers' built-in harnesses install their program with ``uv`` (a PEP 723 script whose packages ``uv`` fetches) on
first use; offline, or where ``uv`` is not installed, that fails. :class:`LocalChatHarness` runs the very same
program (its ``openai`` chat loop: streamed completions, the task's MCP tools) with ``sys.executable``, whose
environment already has those packages when verifiers is installed. The subprocess runtime only: a container does
not have this interpreter.

A taskset module bundles it as its default harness by exporting it beside its taskset::

    from esopt_mp.agent.harnesses.verifiers_chat import LocalChatHarness
    __all__ = ["MyTaskset", "LocalChatHarness"]
"""
from __future__ import annotations

import hashlib
import sys

from verifiers.v1.harnesses.null.harness import NullHarness
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

__all__ = ["LocalChatHarness"]


class _ThisInterpreter:
    """The rollout's runtime as verifiers' launcher sees it, with its uv step replaced: the program is written into
    the runtime's work folder and run by this interpreter."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate=True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f".vf-program-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """verifiers' ``null`` chat harness, its program run by ``sys.executable`` instead of a uv environment."""

    async def setup(self, runtime) -> None:
        if not isinstance(runtime, SubprocessRuntime):
            raise TypeError(f"harness {self.config.id!r} runs on this machine's interpreter: it needs the subprocess "
                            f"runtime (runtime.type subprocess), not {type(runtime).__name__}")

    async def launch(self, ctx, trace, runtime, *args, **kwargs):
        return await super().launch(ctx, trace, _ThisInterpreter(runtime), *args, **kwargs)
