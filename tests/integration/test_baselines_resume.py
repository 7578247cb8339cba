"""A GRPO / PPO run stopped after a step and rerun in its run.dir ends bit-identical to the uninterrupted run.

In-process, on the embedded tiny agent: the stop is the runner's (a request at a step boundary, as a signal
makes it), the rerun a new trainer over the same run.dir. The final checkpoint (weights, AdamW state, PPO's
value head, the update count) and every step's metrics must equal the uninterrupted run's.
"""
import pytest
import torch

from esopt_mp.checkpoint import CheckpointError
from tests.fixtures.baseline_runs import build_baseline_trainer as _trainer, play as _play, same as _same, \
    step_records as _steps

@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_stopped_baseline_run_resumes_bit_identical(tmp_path, algo):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _play(_trainer(ref, algo))["steps"] == 3
    assert _play(_trainer(cut, algo), stop_after=1) == {"stopped_at": 1}
    saved = torch.load(cut / "baseline" / "rank0.pt", weights_only=True)
    assert saved["step"] == saved["updates"] == 1 and saved["layout"] == {"world": 1, "dp": 1, "tp": 1}

    again = _trainer(cut, algo)
    assert again.start_step == 1 and again.optimizer.updates == 1
    summary = _play(again)
    assert summary["resumed_from"] == 1 and summary["steps"] == 3
    want, got = (torch.load(d / "baseline" / "rank0.pt", weights_only=True) for d in (ref, cut))
    assert want["step"] == got["step"] == 3
    for part in ("model", "optimizer", "updates", *(["value_head"] if algo == "ppo" else [])):
        assert _same(want[part], got[part]), part
    assert _same(_steps(ref), _steps(cut))  # step 0 from the first process, 1 and 2 from the resumed one
    assert any(not torch.equal(v, want["model"][k]) for k, v in saved["model"].items())  # steps 2-3 moved them


def test_a_checkpoint_of_another_run_or_length_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert _play(_trainer(run_dir, "grpo"), stop_after=1) == {"stopped_at": 1}
    path = run_dir / "baseline" / "rank0.pt"
    with pytest.raises(CheckpointError, match=r"was written by another configuration \(config hash"):
        _trainer(run_dir, "grpo", "algo.lr=3e-4")
    sd = torch.load(path, weights_only=True)
    torch.save({**sd, "layout": {"world": 2, "dp": 1, "tp": 2}}, path)
    with pytest.raises(CheckpointError, match=r"saved at world 2 = dp 1 x tp 2 and this run is world 1 = dp 1 x "
                                              r"tp 1: a baseline run resumes at the layout it was saved at"):
        _trainer(run_dir, "grpo")
    torch.save({**sd, "step": 5}, path)
    with pytest.raises(CheckpointError, match=r"saved after 5 steps and this run has 3"):
        _trainer(run_dir, "grpo")
    torch.save({**sd, "model": {k: v[:1] for k, v in sd["model"].items()}}, path)
    with pytest.raises(CheckpointError, match=r"cannot resume from it: .*saved \(1, "):
        _trainer(run_dir, "grpo")
