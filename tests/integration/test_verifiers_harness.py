"""A verifiers (v1) environment trained through its own rollout code against the member's endpoint: the example
taskset over reasoning-gym (examples/vf_reasoning_gym.py), verifiers' chat program as a subprocess, its
interception server relaying to the endpoint. Each rollout starts a process (the harness program), so these are
integration tests; they skip without verifiers (pip install 'esopt_mp[verifiers]')."""
import json
import os
import subprocess
import sys
import threading
import types

import pytest

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed: pip install 'esopt_mp[verifiers]'")
reasoning_gym = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (the example's tasks)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
TASKSET = {"id": "vf_reasoning_gym", "dataset": "basic_arithmetic", "size": 8}
CALLABLE = "objective.callable=esopt_mp.agent.harnesses.verifiers_v1:play"


class ScriptedEngine:
    """Replies the text scripted for the conversation's seed (the engine behind the endpoint)."""

    def __init__(self, tok, texts):
        from esopt_mp.engine.base import EngineStats

        self.tokenizer, self.pad_id, self.stats, self.texts = tok, 0, EngineStats(), texts
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def new_conversation(self, cid, seed):
        return types.SimpleNamespace(ids=[], seed=seed)

    def generate(self, convs, new_ids, params, max_new=None):
        from esopt_mp.core.types import Generation

        out = []
        for c, ids in zip(convs, new_ids):
            text = self.texts[c.seed]
            toks = self.tokenizer.encode(text, add_special_tokens=False) + [self.im_end]
            c.ids += list(ids) + toks
            out.append(Generation(toks, text, "eos", len(ids), 0.0))
        return out

    def close(self):
        pass


def test_a_rollout_through_the_endpoint_scores_as_verifiers_does(monkeypatch):
    """Three episodes of one member at once: a right and a wrong answer (the dataset's own score: 1 and 0) and one
    asking for another model (refused by the endpoint: verifiers' provider error, the episode's infra failure)."""
    from transformers import AutoTokenizer

    from esopt_mp.agent.harnesses import verifiers_v1
    from esopt_mp.endpoint import EndpointConfig, EndpointServer
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.envs import InfraError
    from esopt_mp.models.tiny import TINY_AGENT

    monkeypatch.syspath_prepend(EXAMPLES)
    play = verifiers_v1.player({"taskset": TASKSET})
    entries = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=8)
    right, wrong = f"<answer>{entries[2]['answer']}</answer>", "I think <answer>0.5</answer>"
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert (score(entries[2]["answer"], entries[2]), score("0.5", entries[2])) == (1.0, 0.0)
    tok = AutoTokenizer.from_pretrained(TINY_AGENT)
    got = {}
    with EndpointServer(EndpointConfig(batch_window_s=0.05), tok) as server:
        with server.member("member-1-3", [11, 12, 13], SamplingParams(temperature=0, max_new_tokens=32)) as m:
            def episode(k, model, task):
                try:
                    got[k] = play(m.routes[k].base_url, model, task)
                except Exception as e:  # noqa: BLE001 - the test looks at what it raised
                    got[k] = e
            threads = [threading.Thread(target=episode, args=a, daemon=True) for a in
                       [(0, "member-1-3", {"idx": 2}), (1, "member-1-3", {"id": "basic_arithmetic-0-2"}),
                        (2, "member-9-9", {"idx": 2})]]
            for t in threads:
                t.start()
            m.serve(ScriptedEngine(tok, {11: right, 12: wrong, 13: right}),
                    live=lambda: sum(t.is_alive() for t in threads[:2]), until=lambda: not any(t.is_alive()
                                                                                             for t in threads))
            routes = m.routes
    assert got[0] == 1.0 and got[1] == 0.0, got
    assert isinstance(got[2], InfraError) and "ProviderError" in str(got[2]) and "member-9-9" in str(got[2])
    for k in (0, 1):  # verifiers' request, as the endpoint saw it: its session header, the task's messages
        (req,) = routes[k].records
        assert req["session"] and req["reply"]["content"] == (right, wrong)[k]
        assert [msg["role"] for msg in req["messages"]] == ["system", "user"]
        assert req["messages"][1]["content"] == entries[2]["question"]
    (refused,) = routes[2].records  # it reached its route and was refused: no reply, the refusal recorded
    assert "reply" not in refused and "not being served" in refused["error"]
    with pytest.raises(ValueError, match="by 'idx' \\(its position\\) or 'id'"):
        play(routes[0].base_url, "member-1-3", {"question": "?"})
    with pytest.raises(ValueError, match="the taskset has 8 tasks: no idx 99"):
        play(routes[0].base_url, "member-1-3", {"idx": 99})


def test_the_environment_setting_names_a_taskset_or_its_block(tmp_path):
    from esopt_mp.agent.harnesses.verifiers_v1 import env_block

    block = {"taskset": TASKSET, "agent": {"max_turns": 2}}
    (tmp_path / "env.json").write_text(json.dumps(block))
    (tmp_path / "run.toml").write_text('[env.taskset]\nid = "vf_reasoning_gym"\ndataset = "basic_arithmetic"\n'
                                       'size = 8\n[env.agent]\nmax_turns = 2\n')
    assert env_block("vf_reasoning_gym") == {"taskset": {"id": "vf_reasoning_gym"}}
    assert env_block(json.dumps(block)) == env_block(str(tmp_path / "env.json")) == block
    assert env_block(str(tmp_path / "run.toml")) == block
    with pytest.raises(ValueError, match="ESOPT_VERIFIERS_ENV is not set"):
        env_block(" ")


def _train(root, nproc: int = 1):
    """launch/train.py with objective.callable at the adapter (under torchrun at dp=``nproc`` when > 1): 2 steps of 2
    members, one verifiers rollout each; (run dir, summary, ledger without wall-clock times)."""
    from esopt_mp.parallel.local_world import free_port

    tasks, held = root / "tasks.jsonl", root / "eval.jsonl"
    tasks.write_text("".join(json.dumps({"idx": i}) + "\n" for i in range(4)))
    held.write_text(json.dumps({"idx": 7}) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([EXAMPLES, ROOT]),
               ESOPT_VERIFIERS_ENV=json.dumps({"taskset": TASKSET}))
    run_dir = root / "run"
    args = ["objective=harness", CALLABLE, f"objective.tasks={tasks}", f"objective.eval_tasks={held}",
            "es.population=2", "es.steps=2", "es.sigma.kind=constant", "env.episodes_per_step=1", "env.n_eval=1",
            "engine.max_new_tokens=8", "run.eval_every=0", f"parallel.dp={nproc}", f"run.dir={run_dir}"]
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    proc = subprocess.run([*head, "launch/train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    ledger = [{k: v for k, v in json.loads(line).items() if k not in ("wall_time", "sha256")}
              for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return run_dir, summary, ledger


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("vf_dp1"))


def test_two_es_steps_of_the_tiny_agent_through_a_verifiers_environment(one_process):
    """Each episode a verifiers rollout played by the served tiny agent; the returns are the rollouts' rewards,
    recorded in the ledger."""
    run_dir, summary, ledger = one_process
    assert summary["steps"] == 2 and len(ledger) == 2
    assert all(row["failures"] == {"model": 0, "wall_clock": 0, "infra": 0} for row in ledger)
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert sorted((r["step"], r["member"]) for r in train) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    entries = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=8)
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    from reasoning_gym.utils import extract_answer
    for r in train:  # the member's return is its one rollout's reward: the dataset's score of what it replied
        (req,) = r["requests"]
        idx = next(i for i in range(4) if entries[i]["question"] == req["messages"][1]["content"])
        assert r["failure"] is None and req["session"]
        expect = score(extract_answer(req["reply"]["content"]), entries[idx])
        assert r["return"] == expect
        row = ledger[r["step"]]
        assert row["returns"][r["member"]] == expect


def test_the_ledger_at_dp2_equals_the_one_process_ledger(one_process, tmp_path):
    """Under torchrun at dp=2 each dp group serves its own member on its own endpoint, verifiers' rollouts played
    against it: the same seeds, returns and update as one process."""
    run_dir, summary, ledger = _train(tmp_path, nproc=2)
    assert summary["steps"] == 2 and ledger == one_process[2]
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    mine = [(r["step"], r["member"]) for r in rows if r["kind"] == "train"]  # rank 0 writes its group's episodes:
    assert mine and len(set(mine)) == len(mine) < 4  # the members it took from the queue, each once, not the other's


def test_an_environment_that_cannot_be_loaded_stops_the_run_in_one_line(tmp_path):
    """Every episode fails before it asks the endpoint: the first evaluation stops the run, naming verifiers' error."""
    held = tmp_path / "eval.jsonl"
    held.write_text(json.dumps({"idx": 0}) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
               ESOPT_VERIFIERS_ENV="no_such_taskset")
    args = ["objective=harness", CALLABLE, f"objective.tasks={held}", f"objective.eval_tasks={held}",
            "es.population=2", "es.steps=1", "env.episodes_per_step=1", "env.n_eval=1", "engine.max_new_tokens=8",
            f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "launch/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "none of the 1 episodes of eval-0 got a reply" in errors[0]
    assert "taskset 'no_such_taskset' not found (tried to import 'no_such_taskset')" in errors[0]
