"""A GRPO / PPO run stopped after a step and rerun in its run.dir ends bit-identical to the uninterrupted run.

In-process, on the embedded tiny agent: the stop is the runner's (a request at a step boundary, as a signal
makes it), the rerun a new trainer over the same run.dir. The final checkpoint (weights, bf16 runs' fp32 master,
AdamW state, PPO's value head, the update count) and every step's metrics must equal the uninterrupted run's.
"""
import pytest
import torch

from esopt_mp.checkpoint import CheckpointError
from tests.fixtures.baseline_runs import build_baseline_trainer, play, same, step_records

PARTS = ("model", "optimizer", "updates")


def _final(run_dir) -> dict:
    return torch.load(run_dir / "baseline" / "rank0.pt", weights_only=True)


@pytest.mark.parametrize("algo,dtype", [("grpo", "float32"), ("ppo", "bfloat16")])
def test_a_stopped_baseline_run_resumes_bit_identical(tmp_path, algo, dtype):
    ref, cut, more = tmp_path / "ref", tmp_path / "cut", [f"model.dtype={dtype}"]
    assert play(build_baseline_trainer(ref, algo, *more))["steps"] == 3
    assert play(build_baseline_trainer(cut, algo, *more), stop_after=1) == {"stopped_at": 1}
    saved = _final(cut)
    assert saved["step"] == saved["updates"] == 1 and saved["layout"] == {"world": 1, "dp": 1, "tp": 1}

    again = build_baseline_trainer(cut, algo, *more)
    assert again.start_step == 1 and again.optimizer.updates == 1
    summary = play(again)
    assert summary["resumed_from"] == 1 and summary["steps"] == 3
    want, got = _final(ref), _final(cut)
    assert want["step"] == got["step"] == 3
    parts = [*PARTS, *(["value_head"] if algo == "ppo" else []), *(["master"] if dtype != "float32" else [])]
    assert set(want) == {"step", "config_hash", "layout", "rank", *parts}
    for part in parts:
        assert same(want[part], got[part]), part
    assert same(step_records(ref), step_records(cut))  # step 0 from the first process, 1 and 2 from the resumed one
    assert any(not torch.equal(v, want["model"][k]) for k, v in saved["model"].items())  # steps 2-3 moved them


def test_a_checkpoint_cut_short_gives_way_to_the_one_before_it(tmp_path):
    """A crash while a checkpoint was written: the newest file is unreadable, the one before it serves, and the run
    still ends as the uninterrupted one; with no readable file at all the resume is refused, not started over."""
    ref, cut, more = tmp_path / "ref", tmp_path / "cut", ["run.checkpoint_every=1"]
    play(build_baseline_trainer(ref, "grpo", *more))
    assert play(build_baseline_trainer(cut, "grpo", *more), stop_after=2) == {"stopped_at": 2}
    newest, before = cut / "baseline" / "rank0.pt", cut / "baseline" / "rank0.prev.pt"
    assert torch.load(before, weights_only=True)["step"] == 1
    whole = build_baseline_trainer(cut, "grpo", *more)
    assert whole.start_step == 2  # both readable: the newest
    whole.close()
    newest.write_bytes(newest.read_bytes()[:1000])
    again = build_baseline_trainer(cut, "grpo", *more)
    assert again.start_step == 1 and not newest.exists()  # the torn file is gone: the next save cannot keep it
    play(again)
    assert all(same(_final(ref)[p], _final(cut)[p]) for p in PARTS)
    for path in (newest, before):
        path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no checkpoint of rank 0 can be read \(.*rank0.pt: .*\): move "
                                              r"run.dir/baseline aside to start the run over"):
        build_baseline_trainer(cut, "grpo", *more)


def test_a_checkpoint_of_another_run_layout_rank_or_model_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert play(build_baseline_trainer(run_dir, "grpo"), stop_after=1) == {"stopped_at": 1}
    path = run_dir / "baseline" / "rank0.pt"
    with pytest.raises(CheckpointError, match=r"was written by another configuration \(it differs in: .*algo.lr"):
        build_baseline_trainer(run_dir, "grpo", "algo.lr=3e-4")
    sd = torch.load(path, weights_only=True)
    torch.save({**sd, "layout": {"world": 2, "dp": 1, "tp": 2}}, path)
    with pytest.raises(CheckpointError, match=r"saved at world 2 = dp 1 x tp 2 and this run is world 1 = dp 1 x "
                                              r"tp 1: a baseline run resumes at the layout it was saved at"):
        build_baseline_trainer(run_dir, "grpo")
    torch.save({**sd, "rank": 1}, path)  # another rank's file moved here
    with pytest.raises(CheckpointError, match=r"rank0.pt holds rank 1's shards, not rank 0's"):
        build_baseline_trainer(run_dir, "grpo")
    torch.save({**sd, "model": {k: v[:1] for k, v in sd["model"].items()}}, path)
    with pytest.raises(CheckpointError, match=r"cannot resume from it: ValueError: .*saved \(1, "):
        build_baseline_trainer(run_dir, "grpo")
    torch.save({k: v for k, v in sd.items() if k != "layout"}, path)  # a file this version did not write
    with pytest.raises(CheckpointError, match=r"not a baseline checkpoint this version writes \(it has no layout\)"):
        build_baseline_trainer(run_dir, "grpo")


def test_a_resume_sets_a_torn_newest_file_aside_and_a_failed_save_is_one_line(tmp_path):
    """Resumed at the step before its newest file (that file torn), the run must not keep that file as the one
    before its next save (it is moved aside); a save that cannot be written is one line."""
    run_dir, more = tmp_path / "run", ["run.checkpoint_every=1"]
    play(build_baseline_trainer(run_dir, "grpo", *more), stop_after=2)
    newest, before = run_dir / "baseline" / "rank0.pt", run_dir / "baseline" / "rank0.prev.pt"
    newest.write_bytes(b"torn")
    play(build_baseline_trainer(run_dir, "grpo", *more), stop_after=2)  # resumed at 1, saved 2 again
    assert [torch.load(p, weights_only=True)["step"] for p in (newest, before)] == [2, 1]
    assert (run_dir / "baseline" / "rank0.pt.set-aside").read_bytes() == b"torn"
    before.unlink()
    before.mkdir()  # something a save cannot replace
    with pytest.raises(CheckpointError, match=r"rank0.prev.pt is not a regular file: a run writes its checkpoints "
                                              r"itself; remove it"):
        build_baseline_trainer(run_dir, "grpo", *more)
    before.rmdir()
    trainer = build_baseline_trainer(run_dir, "grpo", *more)
    (run_dir / "baseline" / "rank0.pt.tmp").mkdir()  # the write itself fails
    with pytest.raises(CheckpointError, match=r"the checkpoint of step 3 was not written \(RunFileError: .*rank0.pt"
                                              r".tmp is not a regular file.*\); a rerun resumes from the one before"):
        trainer.save(3)
    trainer.close()
