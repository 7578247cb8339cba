"""call_envs: the envs of a batch reset/step at once only when they say ``concurrent``; results never depend on
which call finishes first. The browser worker thread: every call of one episode runs on its one thread."""
import math
import threading
import time

import pytest

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.envs.base import InfraError, call_envs
from esopt_mp.envs.web import worker
from tests.web.scripted import ScriptedEngine


class SiteLost(InfraError):
    pass


class _Env:
    """Replies after ``delay`` s; with ``barrier``, a step only returns once every env of the batch is inside it."""

    name, max_turns, concurrent = "fake", 3, True

    def __init__(self, k, delay=0.0, barrier=None, fail_at=None):
        self.k, self.delay, self.barrier, self.fail_at, self.threads, self.turn = k, delay, barrier, fail_at, set(), 0

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": f"task {task['id']}"}], {}

    def step(self, text):
        self.threads.add(threading.current_thread().name)
        if self.barrier is not None:
            self.barrier.wait()  # BrokenBarrierError unless all envs of the turn step at the same time
        time.sleep(self.delay)
        self.turn += 1
        if self.turn == self.fail_at:
            raise SiteLost(f"env {self.k} lost its site")
        done = self.turn == 2
        return ([] if done else [{"role": "user", "content": f"{self.k}:{self.turn}"}]), float(done) * self.k, done, \
            False, {"turn": self.turn}


def test_concurrent_envs_step_at_once_and_results_stay_in_order():
    barrier = threading.Barrier(3, timeout=10)
    envs = [_Env(k, delay=0.05 * (3 - k), barrier=barrier) for k in range(3)]  # the last finishes first
    out = call_envs([(e, "step", "x") for e in envs])
    assert [o[0][4]["turn"] for o in out] == [1, 1, 1] and [o[1] for o in out] == [None] * 3
    assert [o[0][1] for o in out] == [0.0, 0.0, 0.0] and all(o[2] >= 0 for o in out)
    assert all(e.threads and e.threads.isdisjoint({threading.current_thread().name}) for e in envs)


def test_other_envs_run_one_after_another_on_the_callers_thread():
    envs = [_Env(k) for k in range(3)]
    for e in envs:
        e.concurrent = False
    out = call_envs([(e, "step", "x") for e in envs])
    assert [o[1] for o in out] == [None] * 3
    assert all(e.threads == {threading.current_thread().name} for e in envs)


def test_errors_are_returned_per_call():
    envs = [_Env(0, fail_at=1), _Env(1)]
    (_, err0, _), (res1, err1, _) = call_envs([(e, "step", "x") for e in envs])
    assert isinstance(err0, SiteLost) and "env 0" in str(err0) and err1 is None and res1[4]["turn"] == 1


@pytest.mark.parametrize("concurrent", [True, False])
def test_run_episodes_gives_the_same_episodes_either_way(concurrent):
    """Step durations reversed against the env order: returns, failures and turns as in a sequential run."""
    envs = [_Env(k, delay=0.02 * (4 - k), fail_at=2 if k == 1 else None) for k in range(4)]
    for e in envs:
        e.concurrent = concurrent
    tasks = [{"id": k} for k in range(4)]
    eps = run_episodes(ScriptedEngine([["a", "b"]] * 4), envs, tasks, [0, 1, 2, 3], AgentConfig(max_turns=3))
    assert [e.ret for e in eps if not math.isnan(e.ret)] == [0.0, 2.0, 3.0]
    assert math.isnan(eps[1].ret) and eps[1].error == "step 2: SiteLost: env 1 lost its site"
    assert eps[1].failure == "infra"  # the env says its infrastructure failed: left out, not scored
    assert [len(e.turns) for e in eps] == [2, 1, 2, 2]
    assert [e.ended for e in eps] == ["terminated", "failed", "terminated", "terminated"]
    assert eps[2].turns[0]["messages"] == [{"role": "user", "content": "2:1"}]


def test_worker_runs_every_call_on_its_one_thread_and_stops():
    w = worker.Worker()
    names = {w.call(lambda: threading.current_thread().name) for _ in range(3)}
    assert names == {"esopt-web-browser"} and w.call(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        w.call(divmod, 1, 0)
    ident = w.call(threading.get_ident)
    worker.release(w)
    assert worker.lease() is w and w.call(threading.get_ident) == ident  # an idle worker is reused
    worker.release(w)
    assert worker.stop_idle(timeout=5) >= 1 and not w.alive()


class _Counting:
    """A concurrent env that records how many calls are inside ``step`` at once, and on which threads."""

    name, max_turns, concurrent = "count", 1, True
    lock, inside, peak, threads = threading.Lock(), 0, 0, set()

    def __init__(self, k):
        self.k = k

    def step(self, text):
        cls = type(self)
        with cls.lock:
            cls.inside += 1
            cls.peak = max(cls.peak, cls.inside)
            cls.threads.add(threading.current_thread().name)
        time.sleep(0.002)
        with cls.lock:
            cls.inside -= 1
        return self.k


@pytest.mark.parametrize("workers", [3, 0])
def test_a_large_batch_runs_on_a_bounded_pool_in_env_order(workers):
    """400 held-out episodes are not 400 threads: at most ``max_workers`` (0: the default bound) at a time."""
    from esopt_mp.envs.base import MAX_WORKERS, default_workers

    _Counting.inside, _Counting.peak, _Counting.threads = 0, 0, set()
    out = call_envs([(_Counting(k), "step", "x") for k in range(400)], workers)
    bound = workers or default_workers()
    assert [o[0] for o in out] == list(range(400)) and all(o[1] is None for o in out)
    assert 1 <= len(_Counting.threads) <= bound and _Counting.peak <= bound <= MAX_WORKERS


def test_agent_config_refuses_bad_timeouts_and_worker_counts():
    """The loop refuses what the ``env`` section refuses, in the same words."""
    from esopt_mp.config import ConfigError, build_config

    for key, value in (("episode_timeout_s", 0.0), ("env_workers", -1), ("max_episode_tokens", -1)):
        with pytest.raises(ValueError, match=rf"env\.{key}: must be") as loop:
            AgentConfig(**{key: value})
        with pytest.raises(ConfigError) as cfg:
            build_config({"env": {key: value}})
        assert str(loop.value) == str(cfg.value)


