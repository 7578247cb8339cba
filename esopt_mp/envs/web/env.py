"""``webarena_lite``: WebArena-Lite (or any registered BrowserGym task) played through BrowserGym.

One environment = one browser, opened at ``reset`` and closed when the episode
ends, fails or the process exits. Each reply is parsed into one BrowserGym
high-level action (:mod:`.actions`); an unparseable reply costs a turn and
returns the parse feedback with the unchanged page. The reward is BrowserGym's
(the WebArena evaluators for WebArena tasks), given when the task says done.
Browser faults (a site that stops answering, a browser that died) raise
:class:`~esopt_mp.envs.base.InfraError`s, and the agent loop leaves the
episode out of the member's mean. A step past its time limit is a fault only
if a task's site then fails its probe; with the sites answering it is the
model's (an action that hangs), as is the episode's own wall clock
(``episode_timeout_s``): those score 0. A site that
stops answering mid-episode shows up as a network error of an action or a
Chromium error page; the task's sites are then probed, and one that does not
answer is a fault (:class:`SiteDown`), not feedback to the model.
Each episode's BrowserGym env lives on its own thread (:mod:`.worker`), so the
envs of a batch may step at once (``concurrent = True``, see
:func:`esopt_mp.envs.base.call_envs`).
A task dict: ``{"id", "gym_id", "sites"?, "seed"?}`` (:func:`.tasks.select`).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
import weakref

from esopt_mp.envs.base import InfraError
from esopt_mp.envs.spec import EnvSpec
from esopt_mp.envs.web import stack, worker
from esopt_mp.envs.web.actions import USAGE, ActionError, parse_action
from esopt_mp.envs.web.config import WebConfig
from esopt_mp.envs.web.observation import render

log = logging.getLogger(__name__)
SYSTEM = ("You are a web agent. Each turn you see the goal, the page's accessibility tree (elements carry ids "
          "in [brackets]) and feedback. Think briefly, then end your reply with exactly one action:\n" + USAGE +
          "\nWhen the task asks for information, answer with send_msg_to_user(\"...\"); if it cannot be done, "
          "report_infeasible(\"...\").")
_LIVE: "weakref.WeakSet[WebArenaLiteEnv]" = weakref.WeakSet()
_CHECKED: dict = {}
_READY_LOCK = threading.Lock()


class SiteDown(InfraError):
    """A site the task needs stopped answering during the episode."""


class BrowserFault(InfraError):
    """The episode's browser died, or did not open within ``env.webarena_lite.reset_timeout_s``."""


class StepTimeout(BrowserFault):
    """The browser did not answer within a time limit (its processes were killed)."""


def close_all() -> int:
    """Close every open browser of this process and stop the idle browser threads (atexit, SIGTERM).

    Returns how many browsers were open.
    """
    n = 0
    for env in list(_LIVE):
        n += env.close()
    worker.stop_idle(timeout=5.0)
    return n


def _on_term(signum, frame):  # installed only where nobody else handles SIGTERM
    close_all()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _install_exit_hooks() -> None:
    """atexit, and a SIGTERM handler where nobody handles SIGTERM (signal handlers are set on the main thread only,
    hence also called when an env is made: resets may run on the threads of :func:`esopt_mp.envs.base.call_envs`)."""
    if not _CHECKED.get("atexit"):
        _CHECKED["atexit"] = True
        atexit.register(close_all)
    if _CHECKED.get("sigterm") or threading.current_thread() is not threading.main_thread():
        return
    _CHECKED["sigterm"] = True
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_term)


def ensure_ready(cfg: WebConfig) -> dict:
    """The stack check (:func:`.stack.check`), once per process and configuration."""
    key = (cfg.chromium, cfg.browsers_path, cfg.nltk_data)
    with _READY_LOCK:  # resets may run on several threads; the check exports env variables
        if key not in _CHECKED:
            _CHECKED[key] = stack.check(*key)
        return _CHECKED[key]


class WebArenaLiteEnv:
    name = "webarena_lite"
    concurrent = True  # reset/step wait on a browser, on this instance's own thread: a batch may run them at once

    def __init__(self, max_turns: int = 30, web: WebConfig | None = None):
        self.max_turns = max_turns
        self.cfg = web or WebConfig()
        self.gym = None
        self.task = None
        self._worker: worker.Worker | None = None
        self._http_5xx: list[str] = []  # page loads answered 5xx since the last check (:meth:`_watch_pages`)
        _install_exit_hooks()

    # -- lifecycle -----------------------------------------------------------------------------
    def _open(self, task: dict):
        ensure_ready(self.cfg)
        import gymnasium as gym
        from browsergym.core.action.highlevel import HighLevelActionSet

        if task["gym_id"].startswith("browsergym/webarenalite."):
            import browsergym.webarenalite  # noqa: F401 - registers the 165 gym ids
        elif task["gym_id"].startswith("browsergym/esopt_demo."):
            from esopt_mp.envs.web import demo

            demo.register()
        actions = HighLevelActionSet(subsets=["chat", "infeas", "bid", "nav", "tab"], multiaction=False, strict=True)
        _install_exit_hooks()
        worker.patch_browsergym()
        extra = {"task_kwargs": {"url": task["url"]}} if task.get("url") else {}  # a demo task on its own site
        self._worker = self._worker or worker.lease()
        deadline = time.perf_counter() + self.cfg.reset_timeout_s
        _LIVE.add(self)
        self.gym = self._call("reset_timeout_s", deadline, gym.make, task["gym_id"], headless=True, slow_mo=0,
                              timeout=int(self.cfg.step_timeout_s * 1000), pre_observation_delay=self.cfg.settle_s,
                              action_mapping=actions.to_python_code, wait_for_user_message=False, **extra)
        out = self._call("reset_timeout_s", deadline, self.gym.reset, seed=int(task.get("seed", 0)))
        self._call("reset_timeout_s", deadline, self._watch_pages)
        return out

    def _watch_pages(self) -> None:
        """Record page loads answered with HTTP 5xx (a proxy's 502/503 before a site that is down): they render as
        ordinary pages, with no network error, so :meth:`_check_sites` is told by this record."""
        seen = self._http_5xx = []  # the list, not self, in the callback: the browser does not hold the env

        def on_response(r):
            if r.status >= 500 and r.request.is_navigation_request():
                seen.append(f"HTTP {r.status} from {r.url[:120]}")

        self.gym.unwrapped.context.on("response", on_response)

    def _call(self, key: str, deadline: float, fn, /, *args, **kwargs):
        """``fn`` on this episode's browser thread, given until ``deadline`` (perf_counter) to return; past it
        the browser and its driver are killed (a page whose JavaScript never yields blocks playwright for good)
        and :class:`TimeoutError` names ``env.webarena_lite.<key>``."""
        w, limit = self._worker, getattr(self.cfg, key)
        try:
            return w.call(fn, *args, timeout_s=max(0.0, deadline - time.perf_counter()), **kwargs)
        except worker.CallTimeout:
            self.gym, self._worker = None, None
            _LIVE.discard(self)
            n = w.kill()
            why = f"browser did not answer within env.webarena_lite.{key}={limit:g} s; killed its {n} processes"
            raise (TimeoutError if key == "episode_timeout_s" else StepTimeout)(why) from None

    def close(self) -> int:
        """Close this episode's browser (idempotent) and hand its thread back; 1 if a browser was open."""
        g, self.gym = self.gym, None
        w, self._worker = self._worker, None
        _LIVE.discard(self)
        healthy = True
        if g is not None:
            try:
                w.call(g.close, timeout_s=self.cfg.step_timeout_s + 10)
            except Exception as e:  # noqa: BLE001 - a dead browser must not hide the episode's own error
                log.warning("closing the browser: %s: %s", type(e).__name__, e)
                healthy = False
        if w is not None and healthy:
            worker.release(w)
        elif w is not None:  # failed to close (maybe still stuck in a call): its processes are killed
            w.kill()
        return int(g is not None)

    def __del__(self):
        self.close()

    # -- Env protocol --------------------------------------------------------------------------
    def reset(self, task: dict):
        self.close()
        self.task, self.turn, self.t0 = task, 0, time.perf_counter()
        try:
            obs, info = self._open(task)
        except BaseException:
            self.close()
            raise
        self.obs, self.goal = obs, _goal_text(obs)
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": render(obs, self._tree(obs), self.cfg.obs_tokens, self.goal)}], {
            "id": task.get("id"), "url": obs.get("url")}

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self.gym is None:
            raise RuntimeError("step() after the episode ended")
        self.turn += 1
        out_of_turns = self.turn >= self.max_turns
        try:
            action = parse_action(assistant_text)
        except ActionError as e:
            if out_of_turns:
                self.close()
            page = {**self.obs, "last_action_error": ""}  # the earlier action's error was shown already
            text = render(page, self._tree(self.obs), self.cfg.obs_tokens, self.goal, feedback=str(e))
            return [{"role": "user", "content": text}], 0.0, False, out_of_turns, {"action": None, "feedback": str(e)}
        except BaseException:  # parse_action raises nothing else; were it to, the browser is not left open
            self.close()
            raise
        try:
            t = time.perf_counter()
            limit = min(t + self.cfg.step_timeout_s, self.t0 + self.cfg.episode_timeout_s)
            key = "step_timeout_s" if limit == t + self.cfg.step_timeout_s else "episode_timeout_s"
            try:
                obs, reward, term, trunc, info = self._call(key, limit, self.gym.step, action)
            except StepTimeout as e:
                self._blame_timeout(str(e))
            except (TimeoutError, InfraError):
                raise
            except Exception as e:  # a checked action's own errors come back as last_action_error, not raised
                raise BrowserFault(f"the browser failed the action: {type(e).__name__}: {e}") from e
            step_s, total = time.perf_counter() - t, time.perf_counter() - self.t0
            self._check_sites(obs)
            if step_s > self.cfg.step_timeout_s:
                self._blame_timeout(f"browser step took {step_s:.1f} s > "
                                    f"env.webarena_lite.step_timeout_s={self.cfg.step_timeout_s:g}")
            if total > self.cfg.episode_timeout_s:
                raise TimeoutError(f"episode ran {total:.1f} s > env.webarena_lite.episode_timeout_s={self.cfg.episode_timeout_s:g}")
        except BaseException:
            self.close()
            raise
        self.obs = obs
        meta = {"action": action, "step_s": step_s, "error": obs.get("last_action_error") or None,
                "task_info": info.get("task_info")}
        if term or trunc or out_of_turns:
            self.close()
            return [], float(reward), bool(term), bool(trunc) or out_of_turns, meta
        text = render(obs, self._tree(obs), self.cfg.obs_tokens, self.goal)
        return [{"role": "user", "content": text}], float(reward), False, False, meta

    def _blame_timeout(self, why: str) -> None:
        """A step past ``env.webarena_lite.step_timeout_s`` is the infrastructure's only if a task's site is down
        (:class:`SiteDown`); with every site answering, the action is the model's (a ``goto`` to an address that
        never replies, a page it made hang): :class:`TimeoutError`, scored as its failure, never a free pass."""
        self._probe_sites()
        raise TimeoutError(f"{why}; the task's sites answer, so the action is the model's")

    def _check_sites(self, obs: dict) -> None:
        """After a network error, a Chromium error page or a page load answered with HTTP 5xx: raise
        :class:`SiteDown` if a task's site is down (fails its probe or answers it with 5xx)."""
        error_page = str(obs.get("url", "")).startswith("chrome-error://")
        http_5xx = bool(self._http_5xx)
        self._http_5xx.clear()
        if not (error_page or http_5xx or "net::ERR_" in (obs.get("last_action_error") or "")):
            return  # the model's own bad URL also lands here: only a site of the task that fails a probe is a fault
        self._probe_sites()

    def _probe_sites(self) -> None:
        """:class:`SiteDown` if a site of the task fails its probe or answers it with HTTP 5xx."""
        for site, url in _site_urls(self.task).items():
            try:
                urllib.request.urlopen(url, timeout=self.cfg.preflight_timeout_s).close()
            except urllib.error.HTTPError as e:
                if e.code >= 500:
                    raise SiteDown(f"site {site} ({url}) answers HTTP {e.code}") from None
            except (OSError, ValueError) as e:
                raise SiteDown(f"site {site} ({url}) stopped answering: {getattr(e, 'reason', e)}") from None

    def _tree(self, obs: dict) -> str:
        from browsergym.utils.obs import flatten_axtree_to_str

        return flatten_axtree_to_str(obs["axtree_object"], extra_properties=obs.get("extra_element_properties"),
                                     filter_visible_only=False)


def _site_urls(task: dict) -> dict:
    """The sites a task's episode needs: its WebArena sites (``WA_*``), or the demo site."""
    if task["gym_id"].startswith("browsergym/esopt_demo."):
        from esopt_mp.envs.web import demo

        return {"demo": task.get("url") or demo.site_url()}
    from esopt_mp.envs.web.tasks import site_var

    return {s: os.environ.get(site_var(s), "") for s in task.get("sites", ())}


def _goal_text(obs: dict) -> str:
    goal = obs.get("goal")
    if goal:
        return goal
    parts = [g.get("text", "") for g in obs.get("goal_object") or () if g.get("type") == "text"]
    return "\n".join(p for p in parts if p)


class WebArenaLiteSpec(EnvSpec):
    """``env.webarena_lite``: browser, budgets, task set. Tasks come from its suite's splits; at start-up the browser
    stack and the sites are checked (and the sites reset once, by dp group 0, with ``full_reset``)."""

    config = WebConfig

    def build(self, section, *, max_turns, sandbox=None):
        return WebArenaLiteEnv(max_turns, web=section)

    def make(self, sandbox=None, **kwargs):
        return WebArenaLiteEnv(**kwargs)

    def splits(self, env_cfg, section):
        from esopt_mp.envs.web.tasks import load_split

        return load_split(env_cfg, section)

    def validate(self, section, env_cfg, key):
        section.validate(key)
        if env_cfg.episode_timeout_s < section.episode_timeout_s:
            raise ValueError(f"env.episode_timeout_s: {env_cfg.episode_timeout_s} s (the loop's clock, generation "
                             f"included) is below {key}.episode_timeout_s={section.episode_timeout_s} s (the "
                             "browser's): raise it")

    def check(self, section, env_cfg, first):
        from esopt_mp.envs.web.tasks import startup_check

        startup_check(env_cfg, section, reset=first)

    def syncs_after_check(self, section):
        return section.full_reset  # nobody plays before the sites are reset

    def max_concurrent(self, section):
        return section.max_browsers  # one browser each

    def identity(self, section):  # the task set, budgets and judge choice; not paths nor how many browsers
        web = dataclasses.asdict(section)
        for k in ("chromium", "browsers_path", "nltk_data", "max_browsers", "preflight_timeout_s"):
            web.pop(k)
        return {"web": web}


SPEC = WebArenaLiteSpec()
