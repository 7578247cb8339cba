"""webarena_lite in real headless Chromium: the demo site's tasks, faults, and process hygiene."""
import dataclasses
import http.server
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.envs import InfraError, make
from esopt_mp.envs.web import demo
from esopt_mp.envs.web.config import WebConfig
from esopt_mp.envs.web.env import close_all
from tests.web.conftest import SITES
from tests.web.scripted import ScriptedEngine

CFG = WebConfig(settle_s=0.0, step_timeout_s=20.0)


def _browsers() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True) if "chrom" in p.name().lower()]


def _bid(text: str, role: str, name: str | None = None) -> str:
    pat = rf"\[(\w+)\] {role}" + (rf" '{name}'" if name else "")
    return re.search(pat, text).group(1)


@pytest.fixture
def env():
    e = make("webarena_lite", max_turns=6, web=CFG)
    yield e
    e.close()
    assert not _browsers(), "a browser outlived its episode"


@pytest.mark.parametrize("name,reward", [("Ada", 1.0), ("Bob", 0.0)])
def test_scripted_form_scores_one_and_a_wrong_one_zero(env, name, reward):
    msgs, _ = env.reset(demo.tasks(1)[0])  # seed 0: the name to type is Ada
    obs = msgs[-1]["content"]
    assert "Type Ada into the Name field" in obs
    out, r, term, trunc, info = env.step(f'I fill it. fill("{_bid(obs, "textbox", "Name")}", "{name}")')
    assert (r, term, info["action"]) == (0.0, False, f"fill('{_bid(obs, 'textbox', 'Name')}', '{name}')")
    out, r, term, trunc, info = env.step(f'click("{_bid(obs, "button", "Submit")}")')
    assert (r, term, out) == (reward, True, [])
    assert env.gym is None and not _browsers()  # the episode's end closed its browser


@pytest.mark.parametrize("answer,reward", [(str(demo.code_of(1)), 1.0), ("1234", 0.0)])
def test_answer_task_scored_by_the_task(env, answer, reward):
    env.reset(demo.tasks(1, first_seed=1)[0])  # seed 1: the "code" kind
    out, r, term, _, _ = env.step(f'The code is shown. send_msg_to_user("The code is {answer}")')
    assert (r, term) == (reward, True)


def test_malformed_reply_gets_parse_feedback_and_bad_bid_gets_browsergym_error(env):
    env.reset(demo.tasks(1)[0])
    out, r, term, trunc, info = env.step("I am not sure what to do here.")
    assert info["action"] is None and "no action found" in info["feedback"]
    assert "# Feedback\nno action found" in out[0]["content"] and not term
    out, r, term, trunc, info = env.step('click("zz99")')
    assert 'Could not find element with bid "zz99"' in out[0]["content"] and info["error"]
    assert "# Error from the last action" in out[0]["content"] and not term
    out, r, term, trunc, info = env.step("still unsure")  # feedback for this reply, not the earlier error again
    assert "# Feedback\nno action found" in out[0]["content"] and "zz99" not in out[0]["content"]
    out, r, term, trunc, info = env.step('goto("file:///etc/passwd")')
    assert info["action"] is None and "http:// or https://" in info["feedback"]


def test_turn_budget_truncates_and_closes():
    e = make("webarena_lite", max_turns=2, web=CFG)
    e.reset(demo.tasks(1)[0])
    assert e.step("nothing")[3] is False
    _, r, term, trunc, _ = e.step("still nothing")
    assert (r, term, trunc, e.gym) == (0.0, False, True, None) and not _browsers()


def test_unreachable_site_fails_its_episode_and_the_others_go_on():
    """A WebArena-Lite task on a closed port (WA_REDDIT) fails at reset -> NaN; the demo episode still scores."""
    reddit = 69  # answer-only reddit task
    tasks = [{"id": "webarenalite.69", "gym_id": f"browsergym/webarenalite.{reddit}", "sites": ["reddit"]},
             demo.tasks(1, first_seed=1)[0]]
    envs = [make("webarena_lite", max_turns=3, web=CFG) for _ in tasks]
    eng = ScriptedEngine([["unused"], [f'send_msg_to_user("{demo.code_of(1)}")']])
    eps = run_episodes(eng, envs, tasks, [0, 1], AgentConfig(max_turns=3))
    assert math.isnan(eps[0].ret) and eps[0].ended == "failed" and "ERR_CONNECTION_REFUSED" in eps[0].error
    assert (eps[1].ret, eps[1].ended) == (1.0, "terminated")
    assert SITES["reddit"].startswith("http://127.0.0.1:") and not _browsers()


@pytest.mark.parametrize("handler", [True, False])
def test_sigterm_handler_closes_browsers_a_forked_process_would_keep_alive(handler):
    """The SIGTERM handler is what closes the browsers when the process dies while a fork of it lives.

    Without a handler a process killed by SIGTERM usually leaves no browser either: playwright's driver (node)
    sees its stdin pipe close and kills the browsers it launched. But a process forked after the browser started
    (a data loader, a sandbox, ``os.fork``) inherits that pipe and keeps it open, so the driver and every
    Chromium process outlive the trainer. The child here forks such a process; with the handler removed the
    browsers are still running after the child died (the case the handler exists for), with it they are closed,
    and the handler re-raises SIGTERM so the child's exit status is still -SIGTERM.
    """
    code = ("import os, signal, sys, time; sys.path.insert(0, %r)\n"
            "from esopt_mp.envs import make; from esopt_mp.envs.web import demo\n"
            "from esopt_mp.envs.web.config import WebConfig\n"
            "e = make('webarena_lite', web=WebConfig(settle_s=0.0)); e.reset(demo.tasks(1)[0])\n"
            "%s\n"
            "pid = os.fork()\n"
            "if pid == 0: time.sleep(90); os._exit(0)\n"
            "print('READY', pid, flush=True); time.sleep(120)\n"
            ) % (os.getcwd(), "" if handler else "signal.signal(signal.SIGTERM, signal.SIG_DFL)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    fork, kids = None, []
    try:
        ready, pid = p.stdout.readline().split()
        fork = psutil.Process(int(pid))
        kids = [c for c in psutil.Process(p.pid).children(recursive=True) if "chrom" in c.name().lower()]
        assert ready == "READY" and kids, "the episode's browser is running"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
        gone, alive = psutil.wait_procs(kids, timeout=15 if handler else 3)
        assert fork.is_running(), "the forked process still holds the driver's pipes"
        if handler:
            assert not alive, f"browser processes outlived SIGTERM: {[k.pid for k in alive]}"
        else:
            assert alive, "without the handler the browsers outlive the process (the fork keeps their driver)"
    finally:
        if p.poll() is None:
            p.kill()
        if fork is not None:
            fork.kill()  # the driver then sees its pipe close and takes the browsers down
        _, alive = psutil.wait_procs(kids, timeout=15)
        for k in alive:
            k.kill()


class _SiteKiller(ScriptedEngine):
    """Shuts ``server`` down at the first generation: after every reset, before any step."""

    def __init__(self, replies, server):
        super().__init__(replies)
        self.server = server

    def generate(self, convs, new_ids, params):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        return super().generate(convs, new_ids, params)


def test_site_dying_mid_episode_fails_that_episode_and_the_batch_goes_on():
    """Its server stops after reset: the next page load fails, the site probe says down -> NaN; others score 1."""
    srv, url = demo.serve()
    tasks = [demo.tasks(1, first_seed=1, url=url)[0], *demo.tasks(1, first_seed=3), *demo.tasks(1, first_seed=5)]
    envs = [make("webarena_lite", max_turns=3, web=CFG) for _ in tasks]
    replies = [[f'goto("{url}/?seed=1")'], *([f'send_msg_to_user("{demo.code_of(t["seed"])}")'] for t in tasks[1:])]
    eps = run_episodes(_SiteKiller(replies, srv), envs, tasks, [0, 1, 2], AgentConfig(max_turns=3))
    assert math.isnan(eps[0].ret) and eps[0].ended == "failed" and eps[0].failure == "infra", eps[0]
    assert "SiteDown" in eps[0].error and f"site demo ({url}) stopped answering" in eps[0].error
    assert [(e.ret, e.ended) for e in eps[1:]] == [(1.0, "terminated")] * 2
    assert all(e.gym is None for e in envs) and not _browsers()
    assert close_all() == 0  # nothing open; the idle browser threads and their playwright drivers stop
    assert not [t for t in threading.enumerate() if t.name == "esopt-web-browser"]
    assert not [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def test_step_past_its_time_limit_raises_and_closes():
    """A browser step slower than env.webarena_lite.step_timeout_s while the task's site answers is the model's
    failure (a TimeoutError, not an InfraError: the loop scores it 0, never a free pass)."""
    e = make("webarena_lite", max_turns=4, web=CFG)
    obs = e.reset(demo.tasks(1)[0])[0][-1]["content"]  # playwright's own timeout: 20 s
    e.cfg = dataclasses.replace(CFG, step_timeout_s=1e-4)  # the wall-clock limit every real step exceeds
    with pytest.raises(TimeoutError, match="env.webarena_lite.step_timeout_s=0.0001.*sites answer") as err:
        e.step(f'fill("{_bid(obs, "textbox", "Name")}", "Ada")')
    assert not isinstance(err.value, InfraError)
    assert e.gym is None and not _browsers()


def test_a_reset_past_playwrights_timeout_raises_its_error_and_closes():
    """The page answers after 1 s, so a load limited to 10 ms fails on any machine (playwright's own error)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowPage)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    e = make("webarena_lite", web=WebConfig(settle_s=0.0, step_timeout_s=0.01))
    try:
        with pytest.raises(Exception, match="Timeout 10ms exceeded"):
            e.reset(demo.tasks(1, url=f"http://127.0.0.1:{srv.server_address[1]}")[0])
        assert e.gym is None and not _browsers()
    finally:
        e.close()  # a reset that did succeed leaves no browser to the next test
        srv.shutdown()
        srv.server_close()


_BUSY = (b"<html><body><h1>Busy</h1><button onclick=\"setTimeout(()=>{while(true){}},0)\">Go</button>"
         b"</body></html>")


class _BusyPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(_BUSY)))
        self.end_headers()
        self.wfile.write(_BUSY)

    def log_message(self, *a):
        pass


class _SlowPage(_BusyPage):
    def do_GET(self):  # noqa: N802
        time.sleep(1.0)
        super().do_GET()


def test_a_page_that_never_yields_is_killed_at_the_step_time_limit():
    """Its JavaScript loops forever after a click, so playwright's call never returns: the step's wall clock
    (env.webarena_lite.step_timeout_s) kills the browser, the step raises, and no process is left. The site still
    answers, so the hang is the model's action (a TimeoutError), not the infrastructure's."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BusyPage)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cfg = WebConfig(settle_s=0.0, step_timeout_s=3.0, episode_timeout_s=60.0)
        e = make("webarena_lite", max_turns=4, web=cfg)
        obs = e.reset(demo.tasks(1, url=f"http://127.0.0.1:{srv.server_address[1]}")[0])[0][-1]["content"]
        assert _browsers()
        done = []
        t = threading.Thread(target=lambda: done.append(_raises(e.step, f'click("{_bid(obs, "button", "Go")}")')),
                             daemon=True)
        t.start()
        t.join(60)  # without the kill the click never returns
        assert done and isinstance(done[0], TimeoutError) and not isinstance(done[0], InfraError), done  # the model's
        assert "env.webarena_lite.step_timeout_s=3" in str(done[0]) and "killed its" in str(done[0])
        assert e.gym is None and not _browsers()
        assert close_all() == 0
        assert not [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    finally:
        srv.shutdown()
        srv.server_close()


def _raises(fn, *a):
    try:
        fn(*a)
    except BaseException as ex:  # noqa: BLE001 - returned to the test
        return ex
    return None


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A site behind a proxy: a page while up, then the proxy's 502 (no network error, an ordinary page)."""
    down = False

    def do_GET(self):  # noqa: N802
        body = b"<html><body><p>Secret code: 1</p></body></html>" if not self.down else b"<h1>502 Bad Gateway</h1>"
        self.send_response(502 if self.down else 200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_a_site_behind_a_proxy_answering_502_is_down():
    handler = type("P", (_Proxy,), {"down": False})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        e = make("webarena_lite", max_turns=4, web=CFG)
        e.reset(demo.tasks(1, first_seed=1, url=url)[0])
        out, r, term, _, info = e.step(f'goto("{url}/other")')  # up: an ordinary step
        assert not term and info["error"] is None, (r, term, info, out)
        handler.down = True
        with pytest.raises(Exception, match=r"site demo .* answers HTTP 502") as ex:
            e.step(f'goto("{url}/again")')
        assert type(ex.value).__name__ == "SiteDown"
        assert e.gym is None and not _browsers()
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_configured_chromium_is_the_one_launched(tmp_path, monkeypatch):
    """env.webarena_lite.chromium names a wrapper of the real binary (not the setup link's target): the browser of an
    episode is started through it."""
    from esopt_mp.envs.web import stack

    real = os.path.realpath(stack.browser_link(os.environ["PLAYWRIGHT_BROWSERS_PATH"]))
    wrapper, seen = tmp_path / "my-chromium", tmp_path / "launched"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {seen}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", os.environ["PLAYWRIGHT_BROWSERS_PATH"])  # restored afterwards
    close_all()  # idle playwright drivers keep the browsers path they started with
    try:
        e = make("webarena_lite", max_turns=2, web=dataclasses.replace(CFG, chromium=str(wrapper)))
        e.reset(demo.tasks(1, first_seed=1)[0])
        assert seen.exists() and "--headless" in seen.read_text()
        e.close()
    finally:
        close_all()
    with pytest.raises(stack.WebStackMissing, match="is not an executable file"):
        stack.check(str(tmp_path / "nothing-here"))
