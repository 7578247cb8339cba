"""Skill synthesis through the trainer on the tiny agent: SKILL.md and weights change, the ledger replays both."""
import hashlib
import json
import os
import sys

import pytest
import torch

from esopt_mp.config import build_config
from esopt_mp.prompt import ContextStore, context_hash
from esopt_mp.prompt.skill_edits import parse_skill

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.integration.test_prompt_run import _ledger, _trainer, _weights  # noqa: E402


class AnswerEnv:
    """A one-turn env of any kind: the return is a fixed function of the reply; the feedback names it."""

    name, max_turns = "sudoku", 1

    def reset(self, task):
        return [{"role": "system", "content": "Solve the puzzle."}, {"role": "user", "content": str(task)[:40]}], {}

    def step(self, text):
        score = int(hashlib.sha256(text.encode()).hexdigest()[:4], 16) / 65536.0
        return [{"role": "user", "content": f"score {score:.3f}"}], score, True, False, {}


def _cfg(run_dir, proposer_tokens=16, trajectories=False, every=1, n_train=6, val_tasks=3):
    return build_config({
        "run": {"dir": str(run_dir), "trajectories": trajectories, "checkpoint_every": 0},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
        "es": {"population": 4, "steps": 2, "sigma": {"kind": "constant", "start": 0.05, "end": 0.05},
               "alpha": {"kind": "constant", "start": 0.05, "end": 0.05}},
        "env": {"name": "sudoku", "n_train": n_train, "n_eval": 1, "episodes_per_step": 2, "max_turns": 1},
        "engine": {"max_new_tokens": 6, "temperature": 1.0},
        "prompt": {"optimiser": "skill", "mode": "joint", "every": every,
                   "skill": {"batch": 4, "val_tasks": val_tasks, "max_new_tokens": proposer_tokens}},
    })


@pytest.fixture
def env(monkeypatch):
    import esopt_mp.agent.episodes as episodes

    torch.set_num_threads(1)
    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: AnswerEnv())


def _scripted(monkeypatch, shown):
    """The run's real hooks (validation plays the unperturbed tiny model) with a recorded proposer."""
    import esopt_mp.agent.skill_hooks as skill

    real = skill.skill_hooks

    def hooks(player, cfg):
        h = real(player, cfg)

        def propose(prompt, step, batch):
            shown.append((step, batch, prompt))
            return "```edits\n" + "\n".join([
                json.dumps({"op": "insert", "section": "Strategy", "text": f"- lesson {step}.{batch}"}),
                json.dumps({"op": "insert", "section": "Pitfalls", "text": "- reread the puzzle"}),
                "{broken"]) + "\n```"

        return {**h, "proposer": propose}

    monkeypatch.setattr(skill, "skill_hooks", hooks)


def test_skill_and_weights_change_and_the_ledger_replays_both(tmp_path, env, monkeypatch):
    from esopt_mp.replay import replay

    shown = []
    _scripted(monkeypatch, shown)
    run = tmp_path / "run"
    tr = _trainer(_cfg(run, trajectories=True))
    w0 = _weights(tr.model)
    for t in range(2):
        tr.step(t)
    w, text = _weights(tr.model), tr.context.text
    tr.close()
    led = _ledger(run)
    assert [(s, b) for s, b, _ in shown] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # 8 episodes a step, batches of 4
    assert all("## Strategy" in p and "score 0." in p for _, _, p in shown)  # the skill and the env's feedback
    assert any(not torch.equal(w0[k], w[k]) for k in w0)
    assert led[-1]["context_next"] != led[0]["context"] == context_hash(tr.context.optimiser.initial())
    for e in led:
        s = e["skill"]
        assert s["batches"] == 2 and s["malformed"] == 2 and s["proposed"] == 6 and s["evaluations"] == 2
        assert s["kept"] == (e["context_next"] != e["context"])
        if s["kept"]:
            assert s["val_after"] >= s["val_before"]
        body = parse_skill(ContextStore(str(run)).get(e["context_next"]))[1]
        assert ("- reread the puzzle" in body["Pitfalls"]) == (s["kept"] or e["context"] != led[0]["context"])
    assert "- reread the puzzle" in parse_skill(text)[1]["Pitfalls"]
    logged = [json.loads(line) for line in open(run / "skill.jsonl")]
    assert [r["step"] for r in logged] == [0, 1]
    assert all(r["malformed_lines"][0]["reason"].startswith("not JSON") for r in logged)
    with open(run / "trajectories.jsonl") as f:
        eps = [json.loads(line) for line in f]
    val = [e for e in eps if e["kind"] == "skill_val"]
    assert len(val) == 2 * 2 * 3  # two steps x (current, candidate) x val_tasks, each tagged with its skill
    assert {e["context"] for e in val if e["step"] == 0} == {led[0]["context"], logged[0]["candidate"]}
    assert all(e["context"] == led[e["step"]]["context"] for e in eps if e["kind"] == "train")

    b = _trainer(_cfg(tmp_path / "b"))
    b.step(0)
    b.close()
    b = _trainer(_cfg(tmp_path / "b"))  # resume: the skill from run.dir/contexts, its evaluations from the ledger
    assert b.start_step == 1 and b.context.hash == led[0]["context_next"] and b.context.optimiser.evaluations == 2
    b.step(1)
    b.close()
    assert [e["context_next"] for e in _ledger(tmp_path / "b")] == [e["context_next"] for e in led]

    out = replay(str(run), str(tmp_path / "replayed"))
    from safetensors.torch import load_file

    rep = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(rep[k], w[k]) for k in rep)
    with open(os.path.join(out, "context.txt")) as f:
        assert f.read() == text


def test_the_policy_proposes_with_its_own_unperturbed_weights_deterministically(tmp_path, env):
    """The tiny model writes no edits block: every batch's proposal is dropped with its reason, twice alike."""
    runs = []
    for name in ("a", "b"):
        tr = _trainer(_cfg(tmp_path / name, proposer_tokens=12))
        tr.step(0)
        tr.close()
        runs.append([json.loads(line) for line in open(tmp_path / name / "skill.jsonl")])
    a, b = runs
    assert a == b and a[0]["malformed"] == 2 and a[0]["evaluations"] == 0 and a[0]["decision"] == "no change"
    assert {d["reason"] for d in a[0]["malformed_lines"]} == {"no ```edits block in the proposal"}


def _skill_log(run):
    return [json.loads(line) for line in open(run / "skill.jsonl")] if (run / "skill.jsonl").exists() else []


def test_resume_cuts_skill_jsonl_to_the_ledger(tmp_path, env, monkeypatch):
    """A crash between the skill.jsonl record and the ledger's: the resumed step writes its record once, the same
    one; with no ledger record at all (a crash in step 0) the file is emptied."""
    _scripted(monkeypatch, [])
    run = tmp_path / "run"
    tr = _trainer(_cfg(run))
    tr.step(0)

    def crash(rec):
        raise RuntimeError("killed before the ledger append")

    tr.ledger.append = crash
    with pytest.raises(RuntimeError, match="killed"):
        tr.step(1)
    tr.close()
    torn = _skill_log(run)
    assert [r["step"] for r in torn] == [0, 1] and len(_ledger(run)) == 1
    tr = _trainer(_cfg(run))
    assert tr.start_step == 1 and [r["step"] for r in _skill_log(run)] == [0]
    tr.step(1)
    tr.close()
    assert _skill_log(run) == torn and [e["step"] for e in _ledger(run)] == [0, 1]

    first = tmp_path / "first"
    tr = _trainer(_cfg(first))
    tr.ledger.append = crash
    with pytest.raises(RuntimeError, match="killed"):
        tr.step(0)
    tr.close()
    assert [r["step"] for r in _skill_log(first)] == [0]
    tr = _trainer(_cfg(first))
    assert tr.start_step == 0 and _skill_log(first) == []
    tr.close()


def test_with_every_2_validation_avoids_the_tasks_of_both_steps_the_proposer_read(tmp_path, env, monkeypatch):
    _scripted(monkeypatch, [])
    run = tmp_path / "run"
    tr = _trainer(_cfg(run, every=2, n_train=9, val_tasks=5))
    played, real = [], tr.objective.player.play

    def play(tasks, seeds, cfg, render=None, **tags):
        played.append((tags.get("kind"), tags.get("step"), {id(t) for t in tasks}))
        return real(tasks, seeds, cfg, render=render, **tags)

    tr.objective.player.play = play
    tr.step(0)
    tr.step(1)
    tr.close()
    train = {s: set().union(*(ids for k, st, ids in played if k == "train" and st == s)) for s in (0, 1)}
    val = set().union(*(ids for k, _, ids in played if k == "skill_val"))
    assert train[0] - train[1] and len(val) == 5  # step 0 played a task step 1 did not
    assert not val & (train[0] | train[1])
    assert [(r["step"], r["steps_read"], r["evaluations"]) for r in _skill_log(run)] == [(1, [0, 1], 2)]
    assert "pending" in _ledger(run)[0] and "skill" not in _ledger(run)[0]
