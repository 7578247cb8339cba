"""Unit tests start no process: a test here that forks, spawns or runs a command fails, naming what it started.

A test that needs a child process (launch/train.py, a tool, a CLI, the sandbox, a server, a world of ranks) or a
whole training run belongs in tests/integration or tests/distributed (tests/README.md). The guard holds during
each test's setup, call and teardown, module fixtures included, and only for the tests in this directory.
"""
import multiprocessing.process
import os
import subprocess

import pytest

_TARGETS = ((subprocess.Popen, "_execute_child"), (os, "fork"), (os, "forkpty"), (os, "posix_spawn"),
            (os, "posix_spawnp"), (os, "system"), (multiprocessing.process.BaseProcess, "start"))


def _refuse(what: str):
    def refused(*args, **kwargs):
        shown = what
        if what == "subprocess" and len(args) > 1:  # _execute_child(self, args, ...): the command
            cmd = args[1]
            shown = f"subprocess {cmd if isinstance(cmd, str) else ' '.join(map(str, cmd))[:200]!r}"
        raise RuntimeError(f"a unit test started a process ({shown}): tests/unit run in-process only; "
                           "move the test to tests/integration (tests/README.md)")
    return refused


class _NoChildren:
    def __enter__(self):
        self.saved = [(owner, name, owner.__dict__[name]) for owner, name in _TARGETS if name in owner.__dict__]
        for owner, name, _ in self.saved:
            setattr(owner, name, _refuse("subprocess" if name == "_execute_child" else f"{owner.__name__}.{name}"))

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


# The per-phase hooks are the ones pytest calls through each item's own conftests (the protocol hook is global).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _NoChildren():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _NoChildren():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _NoChildren():
        return (yield)
