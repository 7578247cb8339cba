"""es.noise=lowrank through whole runs: a resume from a mid-run checkpoint and a replay from the ledger give the
uninterrupted run's weights bit for bit, the mode and rank are in the run's identity, and a resume under the other
mode is refused with the setting named.

In-process trainers (model=tiny objective=target_logprob: the returns depend on the weights, so a wrong
perturbation after the resume would change the later returns as well as the weights). The noise itself:
tests/unit/es/test_lowrank.py; the layouts: tests/distributed/test_lowrank_layouts.py.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.inprocess import build_trainer, cut_and_resume, ledger_entries, same_weights, weights

STEPS = 4
ARGS = ["model=tiny", "objective=target_logprob", "objective.batch=2", "es.population=4", f"es.steps={STEPS}",
        "es.noise=lowrank", "es.rank=2", "run.eval_every=0"]


def test_resume_and_replay_equal_the_uninterrupted_run(tmp_path):
    from esopt_mp.checkpoint import LedgerError
    from esopt_mp.replay import replay

    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    t = build_trainer(ref_dir, *ARGS)
    try:
        base = weights(t)
        assert t.perturber.noise == "lowrank" and t.perturber.rank == 2
        assert {k for s, k in zip(t.perturber.shards, t.perturber.kinds) if s.tensor.dim() != 2} == {"none"}
        for step in range(STEPS):
            t.step(step)
        want = weights(t)
    finally:
        t.close()
    moved = {k for k in want if not torch.equal(want[k], base[k])}
    assert moved and all(want[k].dim() == 2 for k in moved)  # only matrices move (no weight decay here)
    fields = json.load(open(ref_dir / "config.json"))["identity"]
    assert (fields["es.noise"], fields["es.rank"]) == ("lowrank", 2)

    # 3 steps, a checkpoint after step 2, then gone (as killed after step 3's entry); resumed to the end
    got = cut_and_resume(lambda d: build_trainer(d, *ARGS), cut_dir, 3, 2, STEPS)
    assert ledger_entries(cut_dir) == ledger_entries(ref_dir)  # returns included: they depend on the weights
    assert same_weights(got, want)

    for use_checkpoint in (False, True):  # base + the whole ledger; the checkpoint + the ledger past it
        out = tmp_path / f"replayed_{use_checkpoint}"
        replay(str(cut_dir), str(out), use_checkpoint=use_checkpoint)
        rep = load_file(os.path.join(out, "model.safetensors"))
        assert rep.keys() == want.keys() and all(torch.equal(rep[k], want[k]) for k in want), use_checkpoint

    with pytest.raises(LedgerError, match="es.noise"):  # the same run dir under full-rank noise: another run
        build_trainer(cut_dir, *[a for a in ARGS if not a.startswith("es.noise")])
