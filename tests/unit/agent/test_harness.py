"""The harness objective without a real server: its settings, loading the harness, and how each episode's run is
classified (a fake of the member API serves the replies of a scripted engine on the calling thread)."""
import contextlib
import json
import math
import queue
import threading
import time
import types

import pytest
from openai import OpenAI

from esopt_mp.agent.harness import HarnessObjective, HarnessPlayer, agree
from esopt_mp.agent.harness_run import HarnessError, HarnessPool, Outcome, command_argv, load_callable
from esopt_mp.config import ConfigError, build_config
from esopt_mp.core.types import Generation
from esopt_mp.engine.base import EngineStats
from esopt_mp.envs import InfraError
from esopt_mp.identity import config_hash
from esopt_mp.core.types import Member
from esopt_mp.parallel import ParallelDims
from tests.web.scripted import ScriptedEngine

DIMS = ParallelDims(1, 1, 1)
ROUTES: dict = {}  # base URL -> the fake route a harness of this module talks to


class FakeRoute:
    def __init__(self, member, k):
        self.member, self.k, self.base_url = member, k, f"fake://{id(member)}/{k}/v1"
        self.records, self.calls = [], 0
        ROUTES[self.base_url] = self

    def chat(self, text: str) -> str:
        """What a harness's chat request does: wait for the serving thread's reply; refused once the gate closed."""
        box = queue.Queue()
        with self.member.lock:
            if self.member.closed:
                raise RuntimeError(f"model {self.member.model!r} is not being served")
            self.member.pending.put((self, text, box))
        return box.get()


class FakeMember:
    def __init__(self, model, seeds, sampling, n):
        self.model, self.seeds, self.sampling = model, seeds, sampling
        self.lock, self.closed, self.pending = threading.Lock(), False, queue.Queue()
        self.routes = [FakeRoute(self, k) for k in range(n)]
        self.convs = {}

    def serve(self, engine, live, until):
        while not until():
            try:
                route, text, box = self.pending.get(timeout=0.005)
            except queue.Empty:
                continue
            conv = self.convs.setdefault(route.k, engine.new_conversation(route.k, self.seeds[route.k]))
            reply = engine.generate([conv], [[1]], self.sampling)[0].text
            route.records.append({"messages": [{"role": "user", "content": text}], "reply": reply})
            route.calls += 1
            box.put(reply)


class FakeServer:
    def __init__(self):
        self.members = []

    @contextlib.contextmanager
    def member(self, model, seeds, sampling):
        m = FakeMember(model, seeds, sampling, len(seeds))
        self.members.append(m)
        try:
            yield m
        finally:
            with m.lock:
                m.closed = True

    def close(self):
        pass


# ---------------------------------------------------------------- harnesses (objective.callable=tests.unit...:name)
def reply_length(base_url, model, task):
    """Two requests; the return is the replies' length: it depends on what the member says."""
    r = ROUTES[base_url]
    return len(r.chat(f"{model} {task['id']}")) + len(r.chat("again")) / 10


def by_task(base_url, model, task):
    do = task.get("do", "win")
    if do == "silent":
        return 1.0
    reply = ROUTES[base_url].chat("hello")
    if do == "raise":
        raise KeyError("the harness's bug")
    if do == "text":
        return "abc"
    if do == "nan":
        return math.nan
    if do == "infra":
        raise InfraError("the tool server is down")
    if do == "sleep":
        time.sleep(20.0)  # past the wall clock below, which leaves the others room on a busy machine
    return float(len(reply))


NOT_CALLABLE = 3


def harness_cfg(tmp_path, fn="by_task", **obj):
    return build_config({"objective": {"name": "harness", "callable": f"tests.unit.agent.test_harness:{fn}", **obj},
                         "model": {"path": "builtin:tiny_agent"}, "run": {"dir": str(tmp_path)},
                         "env": {"name": "sudoku", "n_train": 8, "n_eval": 2, "episodes_per_step": 4}})


def player_of(cfg, replies, traj=None):
    engine = ScriptedEngine(replies)
    return HarnessPlayer(cfg.objective, cfg.env, cfg.engine, cfg.run.seed, engine, DIMS, FakeServer(), "", traj)


# ---------------------------------------------------------------- config and identity
@pytest.mark.parametrize("obj,line", [
    ({}, "objective: objective=harness needs exactly one of objective.callable=pkg.module:fn or "
         "objective.command='program args'"),
    ({"callable": "a:b", "command": "echo"}, "not both"),
    ({"callable": "nocolon"}, "objective.callable: must be 'pkg.module:fn', got 'nocolon'"),
    ({"command": "'unclosed"}, "objective.command: cannot be split into arguments"),
    ({"command": "echo", "concurrency": 0}, "objective.concurrency: must be >= 1, got 0"),
    ({"command": "echo", "timeout_s": 0}, "objective.timeout_s: must be > 0"),
    ({"command": "echo", "failure_return": math.inf}, "objective.failure_return: must be a finite return"),
    ({"command": "echo", "tasks": "/no/such.jsonl"}, "objective.tasks: no such file: /no/such.jsonl"),
])
def test_harness_settings_are_refused_in_one_line(obj, line):
    with pytest.raises(ConfigError, match=None) as e:
        build_config({"objective": {"name": "harness", **obj}})
    assert line in str(e.value) and "\n" not in str(e.value)


def test_the_baselines_refuse_a_harness():
    with pytest.raises(ConfigError, match="algo=grpo needs the token log-probs of its episodes; a harness gives one "
                                          "return per episode: use algo=es"):
        build_config({"objective": {"name": "harness", "command": "echo"}, "algo": {"name": "grpo"}})


def test_harness_fields_enter_the_hash_of_harness_runs_only(tmp_path):
    base = config_hash(build_config({"objective": {"name": "target_logprob"}}))
    assert config_hash(build_config({"objective": {"name": "target_logprob", "callable": "a:b",
                                                   "timeout_s": 5.0, "failure_return": -1.0}})) == base
    h = config_hash(harness_cfg(tmp_path))
    assert config_hash(harness_cfg(tmp_path, timeout_s=5.0, concurrency=2)) == h  # wall clock, threads: never
    assert config_hash(harness_cfg(tmp_path, fn="reply_length")) != h
    assert config_hash(harness_cfg(tmp_path, failure_return=-1.0)) != h
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"id": 1}\n')
    b.write_text('{"id": 1}\n')
    assert config_hash(harness_cfg(tmp_path, tasks=str(a))) == config_hash(harness_cfg(tmp_path, tasks=str(b)))
    b.write_text('{"id": 2}\n')  # the tasks by content, not by path
    assert config_hash(harness_cfg(tmp_path, tasks=str(a))) != config_hash(harness_cfg(tmp_path, tasks=str(b)))


def test_a_harness_that_cannot_be_loaded_is_one_line():
    with pytest.raises(HarnessError, match=r"^objective.callable=no_such_pkg.mod:fn: cannot import no_such_pkg.mod: "
                                           r"ModuleNotFoundError: No module named 'no_such_pkg'$"):
        load_callable("no_such_pkg.mod:fn")
    with pytest.raises(HarnessError, match=r"tests.unit.agent.test_harness has no attribute 'nope'$"):
        load_callable("tests.unit.agent.test_harness:nope")
    with pytest.raises(HarnessError, match=r"NOT_CALLABLE is a int, not callable$"):
        load_callable("tests.unit.agent.test_harness:NOT_CALLABLE")
    with pytest.raises(HarnessError, match=r"^objective.command=no-such-program-xyz --flag: program "
                                           r"'no-such-program-xyz' is not found on PATH$"):
        command_argv("no-such-program-xyz --flag")
    assert load_callable("tests.unit.agent.test_harness:by_task") is by_task


# ---------------------------------------------------------------- episodes
def test_each_way_a_harness_fails_is_its_kind_with_its_error(tmp_path):
    """One episode per way: its return, kind and error, in the trajectories file with its requests."""
    cfg = harness_cfg(tmp_path, timeout_s=3.0)
    traj = tmp_path / "trajectories.jsonl"
    p = player_of(cfg, [["hi!"]] * 8, str(traj))
    do = ["win", "raise", "text", "nan", "infra", "sleep", "silent"]
    eps = p.play([{"id": d, "do": d} for d in do], list(range(len(do))), p.train_cfg, kind="train", step=0, member=1)
    got = {e.id: (e.ret, e.failure) for e in eps}
    assert got["win"] == (3.0, None)
    for d in ("raise", "text", "nan"):
        assert got[d] == (0.0, "model")
    assert got["sleep"] == (0.0, "wall_clock")
    assert math.isnan(got["infra"][0]) and got["infra"][1] == "infra"
    assert math.isnan(got["silent"][0]) and got["silent"][1] == "infra"  # returned 1.0 without asking the model
    errors = {e.id: e.error for e in eps}
    assert errors["raise"] == "raised KeyError: \"the harness's bug\""
    assert errors["text"] == "returned 'abc' is not a number"
    assert errors["nan"] == "returned nan is not a finite number"
    assert errors["sleep"] == "wall clock 3 s exceeded"
    assert errors["silent"].startswith("returned 1.0; it got no reply from the endpoint fake://")
    assert p.take_failures() == [3, 1, 2] and p.take_failures() == [0, 0, 0]
    assert p.take_retried() == [2, 0] and p.take_retried() == [0, 0]  # the two infrastructure failures, again
    rows = [json.loads(line) for line in traj.read_text().splitlines()]
    assert [r["id"] for r in rows] == do and all(r["kind"] == "train" and r["member"] == 1 for r in rows)
    assert rows[0]["return"] == 3.0 and rows[0]["requests"] == [
        {"messages": [{"role": "user", "content": "hello"}], "reply": "hi!"}]
    assert rows[1]["failure"] == "model" and rows[1]["error"] == errors["raise"] and rows[4]["return"] is None
    assert rows[6]["requests"] == []


def test_at_most_concurrency_harnesses_run_at_once():
    seen, now, lock = [], [0], threading.Lock()

    def job(slot):
        with lock:
            now[0] += 1
            seen.append(now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        return Outcome(1.0)

    pool = HarnessPool([job] * 7, concurrency=3, timeout_s=10, failure_return=0.0).start()
    assert pool.wait(10)
    assert max(seen) == 3 and [o.ret for o in pool.outcomes] == [1.0] * 7


def test_a_member_return_depends_on_its_replies_and_the_first_silent_evaluation_stops_the_run(tmp_path):
    cfg = harness_cfg(tmp_path, fn="reply_length")
    p = player_of(cfg, [["abcd", "ef"]] * 4)
    obj = HarnessObjective(p)
    assert obj.evaluate_member(Member(0, 0, 11, 1, 0)) == pytest.approx(4.2)
    assert p.server.members[0].model == "member-0-0" and len(p.server.members[0].seeds) == 4
    silent = HarnessObjective(player_of(harness_cfg(tmp_path, fn="by_task"), [["x"]] * 4))
    silent.player.eval_tasks = [{"id": "q", "do": "silent"}]
    with pytest.raises(HarnessError, match=r"^objective.callable=tests.unit.agent.test_harness:by_task: none of the 1 "
                                           r"episodes of eval-0 got a reply from the endpoint it was given "
                                           r"\(e.g. fake://.*\): no request for this member reached it"):
        silent.evaluate_held_out()
    silent.evaluate_held_out()  # checked once: a later evaluation's silent episodes are infrastructure faults


def test_agree_raises_the_first_failing_line():
    agree(DIMS, None)
    with pytest.raises(HarnessError, match="^boom$"):
        agree(DIMS, "boom")


# ---------------------------------------------------------------- against the real server (loopback, a thread)
LATE: list = []  # what the abandoned harness's request after its wall clock got


class EchoEngine:
    """Replies 'seed S turn T' (the conversation's seed, its turn): a text that names whose reply it is."""

    def __init__(self, tok):
        self.tokenizer, self.pad_id, self.stats = tok, 0, EngineStats()
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def new_conversation(self, cid, seed):
        return types.SimpleNamespace(ids=[], seed=seed, turn=0)

    def generate(self, convs, new_ids, params, max_new=None):
        out = []
        for c, ids in zip(convs, new_ids):
            c.turn += 1
            toks = self.tokenizer.encode(f"seed {c.seed} turn {c.turn}", add_special_tokens=False) + [self.im_end]
            c.ids += list(ids) + toks
            out.append(Generation(toks, self.tokenizer.decode(toks[:-1]), "eos", len(ids), 0.0))
        return out

    def close(self):
        pass


WALL = 4.0  # the harness's wall clock: room for one request on a busy machine; "late" sleeps past it


def _ask(base_url, model, text="hi"):
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}]).choices[0]


def http_harness(base_url, model, task):
    do = task["do"]
    if do == "wrong_model":
        _ask(base_url, "member-9-9")
    reply = _ask(base_url, model).message.content
    if do == "late":  # past its wall clock: its next request meets the closed member
        time.sleep(WALL + 1.5)
        try:
            LATE.append(_ask(base_url, model).message.content)
        except Exception as e:  # noqa: BLE001
            LATE.append(e)
    return float(reply.split()[1]) / 1000


def test_episodes_through_the_real_endpoint_and_an_abandoned_harness_meets_the_closed_member(tmp_path):
    from transformers import AutoTokenizer

    from esopt_mp.endpoint import EndpointConfig, EndpointServer
    from esopt_mp.models.tiny import TINY_AGENT

    import openai

    openai.OpenAI(api_key="none", base_url="http://127.0.0.1:9").chat  # its first use imports much: not in a wall clock
    cfg = harness_cfg(tmp_path, fn="http_harness", timeout_s=WALL)
    tok = AutoTokenizer.from_pretrained(TINY_AGENT)
    with EndpointServer(EndpointConfig(batch_window_s=0.05), tok) as server:
        p = HarnessPlayer(cfg.objective, cfg.env, cfg.engine, 0, EchoEngine(tok), DIMS, server, "",
                          str(tmp_path / "t.jsonl"))
        eps = p.play([{"id": d, "do": d} for d in ("win", "wrong_model", "late")], [7, 8, 9], p.train_cfg,
                     kind="train", step=2, member=5)
        assert eps[0].ret == 0.007 and [e.failure for e in eps] == [None, "infra", "wall_clock"]
        assert eps[1].error.startswith("raised NotFoundError: Error code: 404 - model 'member-9-9' is not being served")
        assert "none of its 1 requests to http://127.0.0.1:" in eps[1].error  # it reached the endpoint, refused
        deadline = time.time() + 10
        while not LATE and time.time() < deadline:
            time.sleep(0.05)
    assert LATE[0].status_code == 404 and LATE[0].body["code"] == "model_not_found"  # never other weights' answer
    assert "model 'member-2-5' is not being served (the member's evaluation ended)" in str(LATE[0])
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [len(r["requests"]) for r in rows] == [1, 1, 1]  # a request for another model: recorded, refused
    assert rows[1]["requests"][0] == {"model": "member-9-9", "seconds": 0.0, "error": rows[1]["requests"][0]["error"]}
    assert "not being served" in rows[1]["requests"][0]["error"] and "reply" not in rows[1]["requests"][0]
    assert rows[0]["requests"][0]["reply"]["content"] == "seed 7 turn 1"


def test_a_returned_number_of_any_real_type_is_the_return_and_anything_else_the_models_failure():
    import decimal
    import fractions

    import numpy as np
    import torch

    from esopt_mp.agent.harness_run import as_return

    for value, want in ((np.float32(0.5), 0.5), (np.int64(1), 1.0), (torch.tensor(0.25), 0.25),
                        (decimal.Decimal("0.75"), 0.75), (fractions.Fraction(1, 4), 0.25), (" 2.5\n", 2.5)):
        out = as_return(value, -1.0, "its return")
        assert (out.ret, out.failure) == (want, None), value
    for value, why in ((np.bool_(True), "(bool) is not a number"), (torch.tensor(True), "(bool) is not a number"),
                       (np.array([1.0, 2.0]), "(ndarray) is not a number"), (10 ** 400, "is not a finite number"),
                       (decimal.Decimal("NaN"), "is not a finite number"), ("many", "is not a number")):
        out = as_return(value, -1.0, "its return")
        assert out.failure == "model" and out.ret == -1.0 and why in out.error and len(out.error) < 200, value


def test_a_player_with_no_episodes_opens_no_member(tmp_path):
    """A dp group whose share of the held-out episodes is empty (fewer episodes than groups) plays none and serves
    no member; it has no silence to report, so the groups that played decide the first evaluation's check."""
    from esopt_mp.engine.base import SamplingParams

    p = player_of(harness_cfg(tmp_path), [["x"]] * 4)
    assert p.play([], [], SamplingParams(), kind="eval", round=0) == []
    assert p.play([], [], SamplingParams(), members=[], kind="train", step=0, member=[]) == []
    assert p.server.members == [] and p.never_called is None
