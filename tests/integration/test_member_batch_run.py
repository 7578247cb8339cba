"""es.member_batch through whole runs on the embedded default (the tiny agent on 4x4 Sudoku): a step plays every
member of the group in one batched generation without touching the weights, each episode as its own member; a
resume from a mid-run checkpoint and a replay from the ledger give the uninterrupted run's ledger and weights bit
for bit; the settings it needs are checked at start-up.

The batched forward itself: tests/unit/engine/test_members.py.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.inprocess import build_trainer, cut_and_resume, ledger_entries, same_weights, weights

STEPS = 3
# one blank and sigma 0.05: the members' returns differ within 2 episodes each (equal returns would update nothing)
ARGS = ["es.noise=lowrank", "es.rank=1", "es.member_batch=true", "es.population=4", f"es.steps={STEPS}",
        "env.episodes_per_step=2", "env.sudoku.mask_count=1", "es.sigma.kind=constant", "es.sigma.start=0.05",
        "run.eval_every=0", "run.trajectories=true"]


def _no_perturb(*a, **k):
    raise AssertionError("a batched step perturbed the weights")


def test_batched_members_resume_and_replay(tmp_path):
    from esopt_mp.replay import replay

    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    t = build_trainer(ref_dir, *ARGS)
    try:
        t.perturber.perturb = _no_perturb
        base = weights(t)
        forwards = []
        t.members._hooks.append(next(iter(t.members.modules)).register_forward_pre_hook(
            lambda mod, args: forwards.append(None if t.members.rows is None else t.members.rows.tolist())))
        t.step(0)
        assert forwards and all(r is not None and set(r) <= {0, 1, 2, 3} for r in forwards)
        assert any(len(set(r)) == 4 for r in forwards)  # the four members' rows share forwards
        for step in range(1, STEPS):
            t.step(step)
        want = weights(t)
    finally:
        t.close()
    assert not same_weights(want, base)
    entries = ledger_entries(ref_dir)
    assert all(len(e["returns"]) == 4 and None not in e["returns"] for e in entries)
    with open(ref_dir / "trajectories.jsonl") as f:
        played = [json.loads(line) for line in f]
    for step in range(STEPS):  # each member's two episodes, under its own index
        mine = sorted(r["member"] for r in played if r.get("step") == step and r.get("kind") == "train")
        assert mine == [0, 0, 1, 1, 2, 2, 3, 3], (step, mine)

    # 2 steps, a checkpoint after step 1, then gone (as killed after step 2's entry); resumed to the end
    got = cut_and_resume(lambda d: build_trainer(d, *ARGS), cut_dir, 2, 1, STEPS)
    assert ledger_entries(cut_dir) == entries  # the batched returns are a function of the weights and the seeds
    assert same_weights(got, want)
    out = tmp_path / "replayed"
    replay(str(cut_dir), str(out))
    rep = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(rep[k], want[k]) for k in want)


@pytest.mark.parametrize("extra, line", [
    (["es.member_batch=true"], "es.noise=lowrank"),
    (["es.noise=lowrank", "es.member_batch=true", "es.restore=subtract"], "es.restore=snapshot"),
    (["es.noise=lowrank", "es.member_batch=true", "objective=target_logprob", "model=tiny"], "objective=target_logprob"),
    (["es.noise=lowrank", "es.member_batch=true", "objective=harness", "objective.callable=m:f", "engine=vllm"],
     "engine=vllm, objective=harness"),
])
def test_what_member_batch_needs_is_one_line(extra, line):
    from esopt_mp.config import ConfigError, build_config
    from tests.fixtures.configs import compose_config

    with pytest.raises(ConfigError, match=line):
        build_config(compose_config(*extra), 1)
