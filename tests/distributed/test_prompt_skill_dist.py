"""Skill synthesis at dp=2 or tp=2 takes the decisions of one process: the policy's proposal is made by dp group 0
(at tp=2 its leader generates, the peer joins the forward passes) and broadcast, the held-out validation is split
over the groups and summed; same skills, validation returns and (dp=2) weights."""
import json
import os

import pytest
import torch

from esopt_mp.parallel.local_world import run_world


def _worker(rank, world, dp, tp, run_dir, out):
    import esopt_mp.agent.skill_hooks as skill
    from esopt_mp.agent.episodes import EpisodePlayer
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tests.integration.test_prompt_skill_run import AnswerEnv, _cfg

    torch.set_num_threads(1)
    real = skill.skill_hooks

    def hooks(player, cfg):
        h = real(player, cfg)

        def propose(prompt, step, batch):  # the policy's real proposal (a collective), then a recorded edit
            said = h["proposer"](prompt, step, batch)
            edit = {"op": "insert", "section": "Strategy", "text": f"- {len(said)} {step}.{batch}"}
            return f"```edits\n{json.dumps(edit)}\n```"

        return {**h, "proposer": propose}

    make, skill.skill_hooks = EpisodePlayer.make_env, hooks
    EpisodePlayer.make_env = lambda *a, **kw: AnswerEnv()
    try:  # the one-process run shares pytest's process: leave the classes as they were
        cfg = _cfg(run_dir)
        cfg.parallel.dp, cfg.parallel.tp = dp, tp
        tr = ESTrainer(cfg, init_distributed(discover(), dp, tp))
        for t in range(2):
            tr.step(t)
        state = {k: v.detach().clone() for k, v in tr.model.state_dict().items()} if tp == 1 else {}
        text = tr.context.text
        tr.close()
    finally:
        skill.skill_hooks, EpisodePlayer.make_env = real, make
    torch.save({"state": state, "text": text}, f"{out}.{rank}")


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_time", "sha256")} for line in f]


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_skill_synthesis_at_dp2_and_tp2_equals_one_process(tmp_path, dp, tp):
    _worker(0, 1, 1, 1, str(tmp_path / "one"), str(tmp_path / "one.pt"))
    run_world(2, _worker, dp, tp, str(tmp_path / "two"), str(tmp_path / "two.pt"))
    one = torch.load(tmp_path / "one.pt.0")
    a, b = _ledger(tmp_path / "one"), _ledger(tmp_path / "two")
    assert [e["context_next"] for e in a] == [e["context_next"] for e in b]
    assert [e["skill"] for e in a] == [e["skill"] for e in b] and all(e["skill"]["evaluations"] == 2 for e in a)
    assert a[-1]["context_next"] != a[0]["context"] and any(e["skill"]["kept"] for e in a)  # the skill changed
    assert [e["returns"] for e in a] == [e["returns"] for e in b]
    for r in range(2):  # every rank holds the same skill (and at dp=2 the same weights) as the one-process run
        got = torch.load(tmp_path / f"two.pt.{r}")
        assert got["text"] == one["text"]
        assert all(torch.equal(got["state"][k], one["state"][k]) for k in got["state"])
