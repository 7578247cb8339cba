"""es.noise=lowrank survives what a cluster does to a run: a SIGKILL mid-step at dp=2 (the same command again ends
with the uninterrupted run's ledger and weights), and resumes at other layouts (dp=2 -> tp=2 -> one process, each
segment loading the previous one's checkpoint) that end bit-identical to one uninterrupted run.

The in-process cut-and-resume and replay of the mode: tests/integration/test_lowrank_run.py."""
import os

import torch
from safetensors.torch import load_file

from tests.integration.test_resume import _cmd, _kill_after_3_entries, _ledger, _run, _weights

LOWRANK = ["es.noise=lowrank", "es.rank=2"]


def test_sigkill_at_dp2_then_rerun_equals_uninterrupted(tmp_path):
    from esopt_mp.checkpoint import checkpoint_steps

    ref, killed = tmp_path / "ref", tmp_path / "killed"
    _run(_cmd(2, ref, LOWRANK))
    _kill_after_3_entries(_cmd(2, killed, LOWRANK), killed)
    assert max((s for s, _ in checkpoint_steps(str(killed))), default=0) < len(_ledger(killed))
    _run(_cmd(2, killed, LOWRANK))
    assert _ledger(killed) == _ledger(ref)  # target_logprob: the returns depend on the weights
    a, b = _weights(ref / "export"), _weights(killed / "export")
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = _weights(ref / "base_model")
    moved = [k for k, v in base.items() if not torch.equal(a[k], v)]
    assert moved and all(a[k].dim() == 2 for k in moved)  # the low-rank mode moved matrices only


def test_resume_at_other_layouts_equals_uninterrupted_run(tmp_path):
    from tests.integration.resume_workers import resume_chain

    out = resume_chain(tmp_path, [(2, 1, 2, 0), (1, 2, 4, 2)], es={"noise": "lowrank", "rank": 2})
    want, last = out["want"], out["last"]["state"]  # the 1x1 finish resumed tp=2's checkpoint at step 4
    assert last.keys() == want.keys() and all(torch.equal(last[k], want[k]) for k in want)
    assert _ledger(out["run"]) == _ledger(out["ref"])
    base = load_file(os.path.join(out["model"], "model.safetensors"))
    assert any(not torch.equal(want[k], v) for k, v in base.items())
