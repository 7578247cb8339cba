"""A prompt optimiser beside ES at dp=2 (each dp group plays half the members, so each holds half the step's
trajectories) takes the same decisions as at dp=1: same context versions, programs, returns and weights."""
import json
import os

import torch

from esopt_mp.parallel.local_world import run_world


def _worker(rank, world, dp, run_dir, out):
    from esopt_mp.agent.episodes import EpisodePlayer
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tests.integration.test_prompt_run import ScoredEnv, _cfg

    torch.set_num_threads(1)
    make, EpisodePlayer.make_env = EpisodePlayer.make_env, lambda *a, **kw: ScoredEnv()
    try:  # the one-process run shares pytest's process: leave the module as it was
        cfg = _cfg(run_dir)
        cfg.parallel.dp = dp
        cfg.env.n_eval, cfg.env.eval_repeats, cfg.env.eval_temperature = 2, 2, 0.7  # 4 held-out episodes
        dims = init_distributed(discover(), dp, 1)
        tr = ESTrainer(cfg, dims)
        for t in range(3):
            tr.step(t)
        state = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
        text = tr.context.text
        seen, render = [], tr.context.render  # held-out episodes: the context each one played, by its global slot
        tr.context.render = lambda seed, slot: seen.append((slot, seed, render(seed, slot))) or seen[-1][2]
        held_out = tr.evaluate()
        tr.close()
    finally:
        EpisodePlayer.make_env = make
    torch.save({"state": state, "text": text, "eval": held_out, "seen": seen}, f"{out}.{rank}")


def _ledger(run_dir):
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_time", "sha256")} for line in f]


def test_context_search_at_dp2_equals_dp1(tmp_path):
    _worker(0, 1, 1, str(tmp_path / "one"), str(tmp_path / "one.pt"))
    run_world(2, _worker, 2, str(tmp_path / "two"), str(tmp_path / "two.pt"))
    one = torch.load(tmp_path / "one.pt.0")
    a, b = _ledger(tmp_path / "one"), _ledger(tmp_path / "two")
    assert [e["context_next"] for e in a] == [e["context_next"] for e in b]
    assert len({e["context_next"] for e in a}) >= 2  # the context did change
    assert [e["programs"] for e in a] == [e["programs"] for e in b] == [8, 8, 8]
    assert [e["returns"] for e in a] == [e["returns"] for e in b]
    two = [torch.load(tmp_path / f"two.pt.{r}") for r in range(2)]
    for got in two:  # every rank holds the same context and weights as the one-process run
        assert got["text"] == one["text"]
        assert all(torch.equal(got["state"][k], one["state"][k]) for k in one["state"])
    # held-out evaluation: each episode (global slot) renders the same context from the same seed at dp=2 as at
    # dp=1 (EoH's operator follows the slot), so the held-out score is the same too
    assert sorted(one["seen"]) == sorted(two[0]["seen"] + two[1]["seen"]) and len(one["seen"]) == 4
    assert len({x for _, _, x in one["seen"]}) >= 2  # the eval episodes did play different operator prompts
    assert two[0]["eval"] == two[1]["eval"] == one["eval"]
