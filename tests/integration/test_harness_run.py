"""Whole ES runs of the tiny agent driven by a harness against the member's endpoint (launch/train.py, as a user
runs it): the scripted 3-turn harness with a tool call at dp=1 and dp=2 (torchrun) and as a command (tp=2: the
endpoint's own test in tests/distributed), the harnesses that cannot run and a port in use (one line each), and
those that fail (each episode its kind and error)."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from esopt_mp.parallel.local_world import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["objective=harness", "es.population=4", "es.steps=2", "es.sigma.kind=constant", "env.episodes_per_step=2",
         "env.n_eval=2", "engine.max_new_tokens=8", "run.eval_every=0"]
SCRIPTED = "objective.callable=scripted_harness:play"


def _run(args, run_dir, nproc=1, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "examples"), ROOT]))
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
             str(free_port())] if nproc > 1 else [sys.executable])
    return subprocess.run(head + ["launch/train.py", *args, f"run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _ledger(run_dir):
    """The ledger without its wall-clock times (and the line checksums covering them): what two runs of one config
    must agree on."""
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("wall_time", "sha256")} for r in rows]


def _rows(run_dir, kind=None):
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The scripted harness as a callable at dp=1: (run dir, summary)."""
    d = tmp_path_factory.mktemp("scripted") / "run"
    return d, _ok(_run([*SHORT, SCRIPTED], d))


def test_a_scripted_harness_trains_and_its_ledger_at_dp2_equals_dp1(scripted, tmp_path):
    """2 ES steps of 4 members, each playing 2 episodes of 3 chat turns (a worked tool call in the opening) through
    the endpoint; under torchrun at dp=2 every group serves its own members on its own port: the same ledger."""
    d1, s1 = scripted
    ledger = _ledger(d1)
    assert s1["steps"] == 2 and len(ledger) == 2
    returns = [r for row in ledger for r in row["returns"]]
    assert all(r is not None and 0.0 <= r <= 1.0 for r in returns)
    assert len(set(returns)) > 1  # the return is the replies' match: it moves with what the members write
    assert all(row["failures"] == {"model": 0, "wall_clock": 0, "infra": 0} for row in ledger)
    train = _rows(d1, "train")
    assert sorted((r["step"], r["member"]) for r in train) == sorted([(t, m) for t in (0, 1) for m in range(4)] * 2)
    for r in train:  # from the endpoint's side: 3 requests, the worked tool call, the member's replies
        assert r["ended"] == "returned" and r["failure"] is None and len(r["requests"]) == 3
        first = r["requests"][0]
        assert first["tools"][0]["function"]["name"] == "calculator"
        assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool"]
        assert first["messages"][2]["tool_calls"][0]["function"]["name"] == "calculator"
        assert all(q["reply"]["role"] == "assistant" and q["usage"]["completion_tokens"] >= 1 for q in r["requests"])
        assert len(r["requests"][2]["messages"]) > len(r["requests"][1]["messages"]) > len(first["messages"])
    d2 = tmp_path / "dp2"
    s2 = _ok(_run([*SHORT, SCRIPTED, "parallel.dp=2"], d2, nproc=2))
    assert s2["steps"] == 2 and _ledger(d2) == ledger
    mine = {(r["step"], r["member"]) for r in _rows(d2, "train")}  # rank 0 writes the episodes its group played
    assert mine and mine < {(t, m) for t in (0, 1) for m in range(4)}  # some members, not all (the other group's)

    def replies(rows):
        return sorted((r["step"], r["member"], r["id"], [q["reply"]["content"] for q in r["requests"]]) for r in rows)
    assert replies(_rows(d2, "train")) == replies(r for r in train if (r["step"], r["member"]) in mine)  # word for word


def test_a_harness_run_resumes_from_its_checkpoint_and_exports_the_same_weights(scripted, tmp_path):
    """Checkpoints and export as for any objective: the same 2 steps (the same ledger as the run without them); its
    last checkpoint and export lost, the same command resumes from step 1's checkpoint, replays step 2 from the
    ledger (no episode played again) and exports the very same weights."""
    from safetensors.torch import load_file

    d = tmp_path / "run"
    args = [*SHORT, SCRIPTED, "run.checkpoint_every=1", "run.export=true"]
    s = _ok(_run(args, d))
    assert s["steps"] == 2 and _ledger(d) == _ledger(scripted[0])
    first = load_file(str(d / "export" / "model.safetensors"))
    played = len(_rows(d, "train"))
    shutil.rmtree(d / "ckpt" / "step_000002")
    shutil.rmtree(d / "export")
    again = _run(args, d)
    assert _ok(again)["resumed_from"] == 2 and "replayed 1 ledger entries" in again.stderr, again.stderr[-3000:]
    assert len(_rows(d, "train")) == played  # nothing played again
    second = load_file(str(d / "export" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _run([*SHORT, SCRIPTED, f"endpoint.port={port}"], tmp_path / "run")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and errors == [f"error: endpoint.port={port}: 127.0.0.1:{port} is in use; choose "
                                               "another port or 0 for a free one"], proc.stderr[-3000:]


def test_the_command_form_plays_the_same_episodes(scripted, tmp_path):
    """The same harness as a command (the task on stdin, OPENAI_* in its environment), one step of the first two
    members (a process per episode is slower; sigma constant: the same at step 0 of a 1-step run): the same returns
    and replies as the callable's."""
    d = tmp_path / "run"
    _ok(_run([*SHORT, f"objective.command={sys.executable} examples/scripted_harness.py", "es.population=2",
              "es.steps=1", "env.n_eval=1"], d))
    (row,) = _ledger(d)
    assert row["seeds"] == _ledger(scripted[0])[0]["seeds"][:2]
    assert row["returns"] == _ledger(scripted[0])[0]["returns"][:2]

    def replies(rows):
        return sorted((r["member"], r["id"], [q["reply"]["content"] for q in r["requests"]]) for r in rows
                      if r["step"] == 0 and r["member"] < 2)
    assert replies(_rows(d, "train")) == replies(_rows(scripted[0], "train"))


@pytest.mark.parametrize("args,line", [
    (["objective.callable=no_such_harness:play"], "error: objective.callable=no_such_harness:play: cannot import "
     "no_such_harness: ModuleNotFoundError: No module named 'no_such_harness'"),
    (["objective.callable=tests.fixtures.harnesses:silent"], "error: objective.callable=tests.fixtures.harnesses:"
     "silent: none of the 2 episodes of eval-0 got a reply from the endpoint it was given (e.g. http://127.0.0.1:"),
], ids=["not_importable", "never_calls"])  # the other lines: tests/unit/agent/test_harness.py
def test_a_harness_that_cannot_run_is_one_line(tmp_path, args, line):
    proc = _run([*SHORT, *args], tmp_path / "run")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(line), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "history.jsonl").exists() or not (tmp_path / "run" / "history.jsonl").read_text()


# a callable's failures (raised, not a number, past its wall clock, silent) are tests/unit/agent/test_harness.py's
@pytest.mark.parametrize("form,dos", [
    (f"objective.command={sys.executable} tests/fixtures/harnesses.py",
     ["win", "exit", "nonumber", "sleep", "leave", "setsid", "badbyte", "errflood"]),
], ids=["command"])
def test_each_failing_harness_is_its_kind_with_its_error(tmp_path, form, dos):
    """Tasks from a JSONL file, one per way to fail: each training episode's kind and error in trajectories.jsonl,
    the ledger's counts, and the member's return the mean with the failures scoring objective.failure_return. Past
    its wall clock the command and every process it started are killed (its sleep would last a minute); one that
    answers and exits leaving a child behind (holding its stdout, in its session or in one of its own) is scored at
    once and the child killed; invalid UTF-8 on stdout or stderr loses no return."""
    tasks, held = tmp_path / "tasks.jsonl", tmp_path / "eval.jsonl"
    pids = tmp_path / "pids"
    tasks.write_text("".join(json.dumps({"id": d, "do": d, "pids": str(pids)}) + "\n" for d in dos))
    held.write_text(json.dumps({"id": "q", "do": "win"}) + "\n")
    d = tmp_path / "run"
    _ok(_run([*SHORT, form, f"objective.tasks={tasks}", f"objective.eval_tasks={held}", "objective.timeout_s=20",
              "objective.failure_return=-1", "es.population=1", "es.mirrored=false", "es.steps=1",
              f"env.episodes_per_step={len(dos)}"],
             d))
    rows = {(r["member"], r["id"]): r for r in _rows(d, "train")}
    assert sorted(rows) == sorted((0, x) for x in dos)  # one member: a wall clock generous for a loaded machine
    expect = {"win": (None, None), "leave": (None, None), "setsid": (None, None), "badbyte": (None, None),
              "errflood": (None, None),
              "raise": ("model", "raised ValueError: the harness's own bug"),
              "sleep": ("wall_clock", "wall clock 20 s exceeded"), "exit": ("model", "exited 3; stderr: giving up"),
              "nonumber": ("model", "its last stdout line 'the answer is unclear' is not a number")}
    wins = [x for x in dos if expect[x] == (None, None)]
    for (m, x), r in rows.items():
        assert (r["failure"], r["error"]) == expect[x], r
        assert len(r["requests"]) == 1 and "reply" in r["requests"][0]  # each asked the member once
        assert (r["return"] == -1.0) == (x not in wins)
    (row,) = _ledger(d)
    fails, slept = len(dos) - len(wins), int("sleep" in dos)
    assert row["failures"] == {"model": fails - slept, "wall_clock": slept, "infra": 0}
    for m, ret in enumerate(row["returns"]):
        assert ret == pytest.approx((sum(rows[(m, x)]["return"] for x in wins) - fails) / len(dos))
    if slept:  # the sleeper and the child it started were killed with its process group
        assert all(not _running(int(pid)) for pid in pids.read_text().split())
    for left in ("left", "setsid"):  # and the children left behind by one that had answered (in its session or not)
        assert all(not _running(int(pid)) for pid in (tmp_path / f"pids.{left}").read_text().split())


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped
    except FileNotFoundError:
        return False


def test_members_served_at_once_play_what_they_play_in_turn(tmp_path):
    """es.member_batch with a harness: a step's four members served at once by one endpoint, each under its own model
    id, their requests in one batch with each row's member terms; the same replies, returns and weights as the same
    low-rank members served one after another with their weights perturbed in place."""
    from safetensors.torch import load_file

    args = [*SHORT, SCRIPTED, "es.noise=lowrank", "es.rank=1", "es.sigma.start=0.05", "run.export=true"]
    turn, batch = tmp_path / "turn", tmp_path / "batch"
    _ok(_run(args, turn))
    _ok(_run([*args, "es.member_batch=true"], batch))
    a, b = _ledger(turn), _ledger(batch)
    assert len(a) == len(b) == 2 and len({r for row in a for r in row["returns"]}) > 1
    # greedy replies: the batch's logits differ from the in-place ones by rounding, far below a chosen token's lead
    assert [row["returns"] for row in a] == [row["returns"] for row in b]

    def replies(d):
        return sorted((r["step"], r["member"], r["id"], [q["reply"]["content"] for q in r["requests"]])
                      for r in _rows(d, "train"))
    assert replies(turn) == replies(batch)
    wa, wb = (load_file(str(d / "export" / "model.safetensors")) for d in (turn, batch))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
