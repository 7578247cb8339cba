"""A failed policy proposal on dp group 0 (the TP leader's generation raising: a tokenizer error, out of memory)
raises the same error on every rank at once: the leader ends its TP peers' follow, rank 0 broadcasts an error
marker instead of the texts. Before, the other ranks waited in the broadcast (and the peers in their follow)
until parallel.timeout_s (1800 s here; the world's timeout below is 60 s)."""
import json
import time

import pytest
import torch

from esopt_mp.parallel.local_world import run_world

BROKEN = "tokenizer: cannot encode the proposer prompt"


def _worker(rank, world, dp, tp, run_dir, out):
    import esopt_mp.agent.loop as loop
    import esopt_mp.agent.skill_hooks as skill
    from esopt_mp.agent.episodes import EpisodePlayer
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer
    from tests.integration.test_prompt_skill_run import AnswerEnv, _cfg

    torch.set_num_threads(1)
    real = skill.generate_texts
    failed_at = []

    def broken(engine, messages, seeds, sampling):  # the real generation with a tokenizer that fails
        encode = loop._encode

        def fail(tok, text):
            failed_at.append(time.time())
            raise ValueError(BROKEN)

        loop._encode = fail
        try:
            return real(engine, messages, seeds, sampling)
        finally:
            loop._encode = encode

    skill.generate_texts, EpisodePlayer.make_env = broken, lambda *a, **kw: AnswerEnv()
    cfg = _cfg(run_dir)
    cfg.parallel.dp, cfg.parallel.tp = dp, tp
    tr = ESTrainer(cfg, init_distributed(discover(), dp, tp))
    try:
        tr.step(0)
        got = {"msg": None}
    except Exception as e:  # every rank reports what it raised (before: rank 0 its own error, the rest waited)
        got = {"msg": f"{type(e).__name__}: {e}"[:300], "raised": time.time()}
    tr.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({**got, "failed_at": failed_at[:1]}, f)


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_a_failed_policy_proposal_raises_on_every_rank_at_once(tmp_path, dp, tp):
    run_world(2, _worker, dp, tp, str(tmp_path / "run"), str(tmp_path / "out"), timeout=60)
    got = [json.load(open(tmp_path / f"out.{r}")) for r in range(2)]
    want = f"RuntimeError: prompt.skill.proposer=policy: the proposal of step 0 failed on rank 0: ValueError: {BROKEN}"
    assert [g["msg"] for g in got] == [want, want]
    assert got[0]["failed_at"] and not got[1]["failed_at"]  # rank 0 (dp group 0's TP leader) generated alone
    lag = max(g["raised"] for g in got) - got[0]["failed_at"][0]
    print(json.dumps({"dp": dp, "tp": tp, "seconds_from_failure_to_the_last_rank_raising": round(lag, 3)}))
    assert not (tmp_path / "run" / "history.jsonl").exists() or not open(tmp_path / "run" / "history.jsonl").read()
