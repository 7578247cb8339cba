"""Browser tests need the offline stack (tools/setup_browser.py); without it they skip, saying what is missing.

The WebArena site variables are read once per process when webarena is first imported, so they are set here,
once, before any test: every site but reddit is a stub login page on loopback; reddit is a closed port.
"""
import os
import socket

import pytest

from esopt_mp.envs.web import demo, stack

try:
    stack.check()
    MISSING = None
except stack.WebStackMissing as e:
    MISSING = str(e)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there afterwards
    return port


SITES = {}
if MISSING is None:
    _srv, _stub = demo.serve(login_only=True)
    SITES = {s: f"{_stub}/{s}" for s in ("shopping", "shopping_admin", "gitlab", "wikipedia", "map", "homepage")}
    SITES["reddit"] = f"http://127.0.0.1:{_closed_port()}"
    for _site, _url in SITES.items():
        os.environ[f"WA_{_site.upper()}"] = _url
    for _k in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):  # no judge here: judged tasks must be excluded
        os.environ.pop(_k, None)


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"browser stack absent: {MISSING}")
    for item in items:
        if "tests/web/" in str(item.fspath).replace(os.sep, "/"):  # the folder: browser tests
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _close_browsers_a_failed_test_left():
    """A test that fails part-way leaves its browser open; closed here, or the next tests' process checks fail too."""
    yield
    if MISSING is None:
        from esopt_mp.envs.web import env

        if env._LIVE:
            env.close_all()
