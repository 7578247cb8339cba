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
    from esopt_mp.models import build_tiny_qwen35
    from esopt_mp.parallel import ParallelDims
    from esopt_mp.parallel.local_world import run_world
    from tests.integration.resume_workers import segment_worker

    es = {"noise": "lowrank", "rank": 2}
    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3, num_hidden_layers=2)
    run, one = str(tmp_path / "run"), ParallelDims(1, 1, 1)
    segment_worker(0, 1, 1, 1, model, str(tmp_path / "ref"), str(tmp_path / "ref.pt"), 6, 6, one, es)
    want = torch.load(tmp_path / "ref.pt")["state"]
    for i, (dp, tp, stop, restored) in enumerate([(2, 1, 2, 0), (1, 2, 4, 2)]):
        run_world(dp * tp, segment_worker, dp, tp, model, run, str(tmp_path / f"seg{i}.pt"), 6, stop, None, es)
        got = torch.load(tmp_path / f"seg{i}.pt")
        assert got["start"] == got["restored"] == restored, (dp, tp, got["start"], got["restored"])
    segment_worker(0, 1, 1, 1, model, run, str(tmp_path / "last.pt"), 6, 6, one, es)  # tp=2's checkpoint at 1x1
    last = torch.load(tmp_path / "last.pt")
    assert last["restored"] == 4
    assert last["state"].keys() == want.keys() and all(torch.equal(last["state"][k], want[k]) for k in want)
    assert _ledger(run) == _ledger(tmp_path / "ref")
    base = load_file(os.path.join(model, "model.safetensors"))
    assert any(not torch.equal(want[k], v) for k, v in base.items())
