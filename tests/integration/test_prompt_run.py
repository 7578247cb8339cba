"""Context and weights evolve together: the ledger replays and resumes both (tiny agent, CPU)."""
import hashlib
import json
import os
import sys

import pytest
import torch

from esopt_mp.config import ConfigError, build_config
from esopt_mp.identity import config_hash
from esopt_mp.parallel import LaunchEnv, init_distributed
from esopt_mp.prompt import ContextStore, context_hash

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


class ScoredEnv:
    """A heuristic-like env: the reply is the program; its score is a fixed function of the text."""

    name, max_turns = "heuristic", 1

    def reset(self, task):
        return [{"role": "system", "content": "Write a heuristic."}, {"role": "user", "content": task["id"]}], {}

    def step(self, text):
        score = int(hashlib.sha256(text.encode()).hexdigest()[:4], 16) / 65536.0
        return [], score, True, False, {"code": text or "pass", "score": score, "error": None}


def _cfg(run_dir, mode="joint", optimiser="eoh", trajectories=False):
    return build_config({
        "run": {"dir": str(run_dir), "trajectories": trajectories, "checkpoint_every": 0},
        "model": {"path": "builtin:tiny_agent"}, "objective": {"name": "agent"},
        "es": {"population": 4, "steps": 4, "sigma": {"kind": "cosine", "start": 0.05, "end": 0.0},
               "alpha": {"kind": "constant", "start": 0.05, "end": 0.05}},
        "env": {"name": "heuristic", "n_train": 4, "n_eval": 1, "episodes_per_step": 2, "max_turns": 1},
        "engine": {"max_new_tokens": 6, "temperature": 1.0},
        "prompt": {"optimiser": optimiser, "mode": mode, "population": 3},
    })


def _trainer(cfg):
    from esopt_mp.trainer import ESTrainer

    return ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def fake_env(monkeypatch):
    import esopt_mp.agent.episodes as episodes

    torch.set_num_threads(1)
    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: ScoredEnv())


def test_context_and_weights_change_and_replay_and_resume_reproduce_both(tmp_path, fake_env):
    from esopt_mp.replay import replay

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a = _trainer(_cfg(a_dir, trajectories=True))
    w0 = _weights(a.model)
    for t in range(4):
        a.step(t)
    wa, ctx_a = _weights(a.model), a.context.text
    a.close()
    led = _ledger(a_dir)
    hashes = [e["context_next"] for e in led]
    assert led[0]["context"] != hashes[-1] and len(set(hashes)) >= 2  # the context changed over the steps
    assert any(not torch.equal(w0[k], wa[k]) for k in w0)  # ... and so did the weights
    assert all(e["programs"] == 4 * 2 for e in led)  # population x episodes x one turn
    for e in led:  # every version is stored once, by its hash
        assert context_hash(ContextStore(str(a_dir)).get(e["context_next"])) == e["context_next"]
    with open(a_dir / "trajectories.jsonl") as f:
        eps = [json.loads(line) for line in f]
    for e in eps:  # each episode played the step's context: its operator prompt opened the conversation
        assert e["context"] == led[e["step"]]["context"] and "(fitness" in e["turns"][0]["prompt"]
    assert len(eps) == 4 * 4 * 2

    b = _trainer(_cfg(b_dir))
    for t in range(2):
        b.step(t)
    b.close()
    b = _trainer(_cfg(b_dir))  # resume: weights from the ledger, context from run.dir/contexts
    assert b.start_step == 2 and b.context.hash == hashes[1]
    for t in range(2, 4):
        b.step(t)
    wb, ctx_b = _weights(b.model), b.context.text
    b.close()
    assert [e["context_next"] for e in _ledger(b_dir)] == hashes and ctx_b == ctx_a
    assert [e["returns"] for e in _ledger(b_dir)] == [e["returns"] for e in led]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    out = replay(str(a_dir), str(tmp_path / "replayed"))
    from safetensors.torch import load_file

    rep = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(rep[k], wa[k]) for k in rep) and set(rep) <= set(wa)
    with open(os.path.join(out, "context.txt")) as f:
        assert f.read() == ctx_a


def test_prompt_only_keeps_the_weights_and_counts_the_same_programs(tmp_path, fake_env):
    t = _trainer(_cfg(tmp_path / "p", mode="prompt_only", optimiser="sample"))
    w0 = _weights(t.model)
    for s in range(2):
        t.step(s)
    assert all(torch.equal(w0[k], v) for k, v in _weights(t.model).items())
    t.close()
    led = _ledger(tmp_path / "p")
    assert [e["programs"] for e in led] == [8, 8] and all(e["alpha"] == 0.0 and e["sigma"] == 0.0 for e in led)
    assert led[-1]["context_next"] != led[0]["context"]  # the best valid program replaced the unscored seed


@pytest.mark.parametrize("mode", ["joint", "prompt_only"])
def test_sample_and_eoh_evaluate_the_same_number_of_programs(tmp_path, fake_env, mode):
    counts = {}
    for opt in ("sample", "eoh"):
        t = _trainer(_cfg(tmp_path / f"{opt}-{mode}", mode=mode, optimiser=opt))
        t.step(0)
        counts[opt] = t.context.programs
        t.close()
    assert counts["sample"] == counts["eoh"] == 4 * 2


@pytest.mark.parametrize("override,key", [
    ({"prompt": {"optimiser": "beam"}}, "prompt.optimiser"),
    ({"prompt": {"mode": "sometimes"}}, "prompt.mode"),
    ({"prompt": {"every": 0}}, "prompt.every"),
    ({"prompt": {"optimiser": "eoh", "population": 0}}, "prompt.population"),
    ({"prompt": {"optimiser": "eoh"}, "env": {"name": "sudoku"}}, "prompt.optimiser"),
    ({"prompt": {"optimiser": "eoh"}, "env": {"name": "heuristic", "n_train": 8}, "algo": {"name": "grpo"}},
     "prompt.optimiser"),
    ({"prompt": {"optimiser": "eoh", "colour": 1}}, "prompt.colour"),
])
def test_bad_prompt_config_is_refused_naming_the_key(override, key):
    data = {"objective": {"name": "agent"}, "env": {"name": "heuristic"}, **override}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(data)


def test_default_prompt_section_keeps_the_hash():
    assert config_hash(build_config({}), None) == "c999d5ed83fd066a"
    on = build_config({"objective": {"name": "agent"}, "env": {"name": "heuristic"}, "prompt": {"optimiser": "eoh"}})
    off = build_config({"objective": {"name": "agent"}, "env": {"name": "heuristic"}})
    assert config_hash(on, None) != config_hash(off, None)


def test_eoh_es_profile_composes_with_the_test_time_sigma_schedule():
    from esopt_mp.es import Schedule
    from tests.fixtures.configs import compose_config

    cfg = build_config(compose_config("+experiment=ahd_eoh_es"), 1)
    s = cfg.es.sigma
    assert (cfg.prompt.optimiser, cfg.prompt.mode, cfg.env.name) == ("eoh", "joint", "heuristic")
    from esopt_mp.trainer import _schedule

    assert s.steps is None  # follows es.steps: an es.steps override keeps sigma_T = 0 at the last step
    for steps in (cfg.es.steps, 7, 1):
        sched = _schedule(s, steps)
        assert isinstance(sched, Schedule) and sched(steps - 1) == 0.0 < s.start
        assert steps == 1 or sched(steps - 2) > 0.0


def test_sigma_zero_step_updates_nothing_and_replays(tmp_path, fake_env):
    # the last step of a test-time schedule plays sigma = 0: the members differ only by sampling noise, so an
    # update with alpha > 0 was a random walk (max |dtheta| 0.13 on the tiny agent); alpha is recorded as 0
    from esopt_mp.replay import replay

    cfg = _cfg(tmp_path / "z")
    cfg.es.steps = 2
    t = _trainer(cfg)
    t.step(0)
    w0 = _weights(t.model)
    rec = t.step(1)
    w1 = _weights(t.model)
    t.close()
    assert rec["sigma"] == 0.0 and rec["alpha"] == 0.0
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    led = _ledger(tmp_path / "z")
    assert led[0]["sigma"] > 0 and led[0]["alpha"] > 0 and (led[-1]["sigma"], led[-1]["alpha"]) == (0.0, 0.0)
    from safetensors.torch import load_file

    rep = load_file(os.path.join(replay(str(tmp_path / "z"), str(tmp_path / "r")), "model.safetensors"))
    assert all(torch.equal(rep[k], w1[k]) for k in rep)


def test_ahd_table_runs_at_equal_budget(tmp_path, monkeypatch, capsys):
    """The table script end to end on the tiny agent: four methods, equal counted budgets, a markdown table."""
    from tools import ahd_table

    torch.set_num_threads(1)
    monkeypatch.setattr(sys, "argv", ["ahd_table", "--problems", "bpp_online", "--seeds", "0", "--steps", "1",
                                      "--population", "2", "--episodes", "1", "--max-new-tokens", "8",
                                      "--out", str(tmp_path)])
    ahd_table.main()
    out = json.loads(capsys.readouterr().out)
    cells = out["results"]["bpp_online"]
    assert set(cells) == set(ahd_table.METHODS) and {c[0]["programs"] for c in cells.values()} == {2}
    assert all(c[0]["objective"] > 0 for c in cells.values())  # a gap to the bound, of the best (or seed) heuristic
    with open(tmp_path / "table.md") as f:
        assert "| bpp_online (gap, lower) |" in f.read()
    for m in ahd_table.METHODS:  # a 1-step run plays the schedule's end: sigma = 0, nothing updated
        led = _ledger(tmp_path / "bpp_online" / m.replace("+", "_") / "seed0")
        assert (led[-1]["sigma"], led[-1]["alpha"]) == (0.0, 0.0)


@pytest.mark.parametrize("optimiser", ["sample", "eoh"])
def test_seed_program_is_evaluated_once_and_competes_with_its_fitness(tmp_path, fake_env, optimiser):
    # the seed was unscored (fitness None), so any first valid program, however bad, replaced it
    from esopt_mp.envs import ahd
    from esopt_mp.prompt import EoHSearch, SampleSearch

    search = SampleSearch if optimiser == "sample" else EoHSearch
    t = _trainer(_cfg(tmp_path / optimiser, mode="prompt_only", optimiser=optimiser))
    ref = ahd.get(t.cfg.env.heuristic.problem).reference()
    _, want, _, _, _ = ScoredEnv().step(f"```python\n{ref.rstrip()}\n```")  # the env's score of the seed reply
    seed = search.best(t.context.text)
    assert seed["op"] == "seed" and seed["fitness"] == pytest.approx(want) and t.context.seed_fitness == seed["fitness"]
    scores, step = [], t.context.step  # the trajectories each step hands the prompt optimiser
    t.context.step = lambda s, trajs: scores.extend(p.score for tr in trajs for p in tr.programs) or step(s, trajs)
    for s in range(2):
        t.step(s)
    t.close()
    best = search.best(t.context.text)
    assert best["fitness"] == pytest.approx(max(scores + [want]))
    assert (best["op"] == "seed") == (want >= max(scores))


def test_heuristic_search_scores_every_program_on_the_same_instances(tmp_path, fake_env):
    """Sample/EoH compare fitness across programs, steps and the seed: one instance set for all of them."""
    tr = _trainer(_cfg(tmp_path / "a", optimiser="sample"))
    tasks = [tr.objective.player.step_tasks(t) for t in range(3)]
    tr.close()
    first = tasks[0][0]
    assert all(t is first for step in tasks for t in step) and len(tasks[0]) == 2


@pytest.mark.parametrize("mirrored", [False, True])
def test_eoh_operators_follow_the_episode_slots_of_a_step(tmp_path, fake_env, mirrored):
    """Each training episode renders with its slot (step + pair * episodes_per_step + episode; pair = member
    without mirrored sampling, member // 2 with it); the operator of a slot is both the prompt it played and the op
    its offspring records. The two members of a mirrored pair play the same contexts (operator and parents); the
    next step's slots are shifted by one, so an operator a step has too few slots for runs later."""
    from esopt_mp.envs.ahd.bpp_online import BPPOnline
    from esopt_mp.prompt.search import operator

    cfg = _cfg(tmp_path, mode="prompt_only")
    cfg.es.mirrored = mirrored
    t = _trainer(cfg)
    assert json.loads(t.context.text)["population"][0]["thought"] == BPPOnline.reference_thought  # best fit
    seen, render, step, handed = [], t.context.render, t.context.step, []
    t.context.render = lambda seed, slot: seen.append((slot, render(seed, slot))) or seen[-1][1]
    t.context.step = lambda s, trajs: handed.append(trajs) or step(s, trajs)  # what the prompt optimiser reads
    t.step(0)
    trajs = handed[0]
    pop = json.loads(t.context.text)["population"]
    n = len(seen)
    t.step(1)
    later = [s for s, _ in seen[n:]]
    del seen[n:]
    t.close()
    want = [m // 2 * 2 + e for m in range(4) for e in range(2)] if mirrored else list(range(8))  # 4 members x 2
    assert [s for s, _ in seen] == want == [tr.slot for tr in trajs] and later == [s + 1 for s in want]
    assert [tr.member for tr in trajs] == [m for m in range(4) for _ in range(2)]
    texts = [x for _, x in seen]
    if mirrored:  # member 2k+1 (sign -1) sees exactly what member 2k (sign +1) saw
        assert texts[2:4] == texts[0:2] and texts[6:8] == texts[4:6]
    for slot, text in seen:  # one individual rendered: m1 and m2 alternate
        assert ("modified version" in text) == (operator(1, slot) == "m1") and "inside braces" in text
    made = {}
    for tr in trajs:  # a code two episodes wrote enters once, with the first one's operator
        for p in tr.programs:
            made.setdefault(p.code, operator(1, tr.slot))
    kids = [p for p in pop if p["op"] != "seed"]
    assert kids and all(p["op"] == f"{made[p['code']]}@0" and "thought" in p for p in kids)


def test_score_program_closes_the_env_also_when_it_raises(tmp_path, monkeypatch):
    import esopt_mp.agent.episodes as episodes

    closed = []

    class Failing(ScoredEnv):
        def step(self, text):
            raise RuntimeError("sandbox died")

        def close(self):
            closed.append(True)

    torch.set_num_threads(1)
    t = _trainer(_cfg(tmp_path / "run", mode="prompt_only"))  # its seed scoring ran the real env
    monkeypatch.setattr(episodes.EpisodePlayer, "make_env", lambda *a, **kw: Failing())
    try:
        with pytest.raises(RuntimeError, match="sandbox died"):
            t.objective.player.score_program("def score(item, bins):\n    return bins")
        assert closed == [True]
    finally:
        t.close()
