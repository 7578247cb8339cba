"""The run loop on a fake trainer (no model, no process group): what it calls when, what it logs, how it stops."""
import json
import logging
import os
import signal
from types import SimpleNamespace

import pytest

from esopt_mp.config import RunConfig, TrainConfig, build_config
from esopt_mp.identity import config_hash, config_identity
from esopt_mp.metrics import MetricsWriter, summary_screen
from esopt_mp.runfiles import write_config
from esopt_mp.runner import Stop, run

COMM_BYTES = 600


class AnyComm:
    """The stop agreement's all-reduce on one rank: the verdict is the local flag; every call is recorded."""

    def __init__(self):
        self.flags = []

    def any(self, flag: bool) -> bool:
        self.flags.append(flag)
        return flag

    def broadcast_object(self, obj=None, src=0, dim="tp"):
        return obj


class FakeTrainer:
    name = "fake"
    resumes = True
    reuses_held_out = True

    def __init__(self, run_dir, steps=5, start=0, rank=0, third="sigma", signal_at=None, **run):
        self.cfg = TrainConfig(run=RunConfig(dir=str(run_dir), **run))
        self.dims = SimpleNamespace(rank=rank, comm=AnyComm())
        os.makedirs(run_dir, exist_ok=True)
        self.metrics = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), rank)
        self.start_step, self.steps, self.third, self.signal_at = start, steps, third, signal_at
        self.comm_stats = SimpleNamespace(total=COMM_BYTES)
        self.calls, self.evals = [], 0

    def step(self, t):
        self.calls.append(("step", t))
        if t == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # mid-step, as a scheduler's warning arrives
        return {"step": t, "return_mean": t / 10, "return_max": t / 5, self.third: 0.01, "rollout_s": 1.0,
                "step_s": 1.5}

    def evaluate(self):
        self.calls.append(("evaluate",))
        self.evals += 1
        if self.signal_at == "evaluate":
            os.kill(os.getpid(), signal.SIGTERM)  # the first evaluation of a run is under way
        return self.evals / 100

    def save(self, step):
        self.calls.append(("save", step))

    def poll(self):
        self.calls.append(("poll",))

    def wait(self):
        self.calls.append(("wait",))

    def finish(self):
        self.calls.append(("finish",))
        return {"params_local": 42}

    def close(self):
        self.calls.append(("close",))


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_order_of_calls_and_the_cadences(tmp_path):
    tr = FakeTrainer(tmp_path, steps=5, log_every=2, eval_every=2, checkpoint_every=3)
    summary = run(tr)
    assert tr.calls == [("evaluate",),
                        ("step", 0), ("poll",),
                        ("step", 1), ("evaluate",), ("poll",),
                        ("step", 2), ("save", 3), ("poll",),
                        ("step", 3), ("evaluate",), ("poll",),
                        ("step", 4), ("save", 5), ("wait",),  # the last step: the final checkpoint, waited for
                        ("evaluate",), ("finish",)]  # close is the caller's
    assert tr.dims.comm.flags == [False] * 7  # before and after the first evaluation, then one per step
    rows = _records(tmp_path)
    assert rows[1] == {"run_start": 0}  # after the first score: where this run began (a resume's check)
    rows = rows[:1] + rows[2:]
    assert [(r.get("step"), r.get("eval_step")) for r in rows[:-1]] == \
        [(None, 0), (0, None), (None, 2), (2, None), (None, 4), (4, None), (None, 5)]
    assert [r["eval"] for r in rows if "eval" in r] == [0.01, 0.02, 0.03, 0.04]
    assert rows[-1] == {"summary": summary}
    assert set(summary) == {"eval_before", "eval_after", "steps", "resumed_from", "seconds", "comm_bytes_per_step",
                            "params_local", "peak_gpu_bytes" if "peak_gpu_bytes" in summary else "peak_rss_bytes"}
    assert (summary["eval_before"], summary["eval_after"], summary["steps"], summary["resumed_from"]) == \
        (0.01, 0.04, 5, 0)
    assert summary["comm_bytes_per_step"] == COMM_BYTES / 5 and summary["params_local"] == 42
    assert (tmp_path / "training.png").stat().st_size > 0


def test_the_last_step_is_logged_and_no_eval_repeats_the_final_one(tmp_path):
    tr = FakeTrainer(tmp_path, steps=4, log_every=3, eval_every=4, checkpoint_every=0)
    run(tr)
    rows = _records(tmp_path)
    assert [r["step"] for r in rows if "step" in r] == [0, 3]
    assert [r["eval_step"] for r in rows if "eval" in r] == [0, 4]
    assert [c for c in tr.calls if c[0] == "save"] == [("save", 4)]


@pytest.mark.parametrize("resumes", [True, False])
def test_a_signal_mid_step_checkpoints_after_that_step_and_stops(tmp_path, resumes, caplog):
    before = signal.getsignal(signal.SIGUSR1)
    tr = FakeTrainer(tmp_path, steps=5, signal_at=1, checkpoint_every=0)
    tr.resumes = resumes
    with caplog.at_level(logging.WARNING, logger="esopt_mp.runner"):
        assert run(tr) == {"stopped_at": 2}
    # the line says what a rerun does: resume, or (a trainer that cannot resume) nothing of this run.dir
    assert ("rerun the same command to resume" in caplog.text) is resumes
    assert ("this FAKE run cannot resume: a rerun starts in a new run.dir" in caplog.text) is not resumes
    assert tr.calls == [("evaluate",), ("step", 0), ("poll",), ("step", 1), ("save", 2), ("wait",)]
    assert tr.dims.comm.flags == [False, False, False, True]
    assert signal.getsignal(signal.SIGUSR1) == before  # the run's handler is gone with the run
    assert not any("summary" in r for r in _records(tmp_path))


def test_a_stop_on_the_last_step_finishes_the_run(tmp_path):
    tr = FakeTrainer(tmp_path, steps=1, checkpoint_every=0, signal_at=0)
    summary = run(tr)
    assert tr.calls == [("evaluate",), ("step", 0), ("save", 1), ("wait",), ("evaluate",), ("finish",)]
    assert summary["steps"] == 1


def test_a_stop_before_the_first_step_ends_the_run_before_it(tmp_path, caplog):
    """A request made as the model loaded (a launcher's handler) costs no evaluation and no step; one made during
    the first evaluation keeps its score (a rerun reuses it) and takes no step."""
    tr = FakeTrainer(tmp_path / "a", steps=4, start=2)
    with caplog.at_level(logging.WARNING, logger="esopt_mp.runner"):
        assert run(tr, Stop(requested=True)) == {"stopped_at": 2}
    assert tr.calls == [] and tr.dims.comm.flags == [True]
    assert "stopped before step 3/4 on request; nothing new to save" in caplog.text
    tr = FakeTrainer(tmp_path / "b", steps=4, signal_at="evaluate")
    assert run(tr) == {"stopped_at": 0}
    assert tr.calls == [("evaluate",)] and tr.dims.comm.flags == [False, True]
    assert [(r.get("eval_step"), r.get("eval")) for r in _records(tmp_path / "b")] == [(0, 0.01), (None, None)]


def test_a_resumed_run_starts_at_its_step(tmp_path):
    tr = FakeTrainer(tmp_path, steps=5, start=3, checkpoint_every=0)
    summary = run(tr)
    assert [c[1] for c in tr.calls if c[0] == "step"] == [3, 4]
    assert [r["eval_step"] for r in _records(tmp_path) if "eval" in r] == [3, 5]
    assert summary["resumed_from"] == 3 and summary["comm_bytes_per_step"] == COMM_BYTES / 2


def test_a_resumed_run_reuses_the_score_recorded_at_its_step_under_the_same_settings(tmp_path, caplog):
    """The weights a resume restores are those evaluated before the stop, bit for bit: their score is not
    evaluated again. A score of another step, or recorded under other settings (a changed ``env.n_eval``), is not
    reused."""
    first = FakeTrainer(tmp_path, steps=5, eval_every=2, checkpoint_every=0, signal_at=2)
    assert run(first) == {"stopped_at": 3}
    # stopped after step 3: scores recorded at 0 and 2, none at 3: evaluated there
    again = FakeTrainer(tmp_path, steps=5, start=3, eval_every=2, checkpoint_every=0)
    run(again)
    assert again.calls[0] == ("evaluate",)
    tr = FakeTrainer(tmp_path, steps=6, start=4, eval_every=2, checkpoint_every=0)  # 4 was evaluated by `again`
    tr.evals = 7
    with caplog.at_level(logging.INFO, logger="esopt_mp.runner"):
        summary = run(tr)
    assert ("evaluate",) not in tr.calls[:2] and tr.calls[0] == ("step", 4)
    assert summary["eval_before"] == 0.02 and summary["eval_after"] == 0.08
    assert "held-out score at step 4: 0.0200 (recorded before the stop, not evaluated again)" in caplog.text
    assert [r["eval_step"] for r in _records(tmp_path) if "eval" in r] == [0, 2, 3, 4, 5, 6]
    other = FakeTrainer(tmp_path, steps=6, start=4, checkpoint_every=0)
    other.cfg.env.n_eval += 1  # another held-out set: evaluated again
    run(other)
    assert other.calls[0] == ("evaluate",)


def test_a_score_a_later_start_may_have_outdated_is_evaluated_again(tmp_path):
    """A run that started before a recorded score's step, after it was recorded (a crash rolled it back to an
    older checkpoint; a requeue on a GPU, whose kernels need not repeat a step's weights), passed that step again
    with weights nobody scored (here another ``run.eval_every``): a resume at that step evaluates."""
    assert run(FakeTrainer(tmp_path, steps=6, eval_every=2, checkpoint_every=0, signal_at=3)) == {"stopped_at": 4}
    assert [r["eval_step"] for r in _records(tmp_path) if "eval" in r] == [0, 2, 4]
    # the checkpoint at 4 was lost: the requeue goes on from 2 without scoring 4 again and stops after it
    assert run(FakeTrainer(tmp_path, steps=6, start=2, checkpoint_every=0, signal_at=3)) == {"stopped_at": 4}
    tr = FakeTrainer(tmp_path, steps=6, start=4, checkpoint_every=0)
    run(tr)
    assert tr.calls[0] == ("evaluate",)


@pytest.mark.parametrize("case", ["link", "not_a_number", "too_large", "infra", "served"])
def test_no_reuse_from_a_link_a_non_number_an_infra_fault_or_a_harness(tmp_path, case, caplog):
    """metrics.jsonl replaced by a link is not read through (the run evaluates; the write after it refuses the
    link); a recorded score that is not a finite number (or not even a float) is not reused, nor one whose
    evaluation lost episodes to an infrastructure fault; a harness's run evaluates (its first evaluation is also
    its check, on every rank at once, that it calls its endpoint)."""
    run(FakeTrainer(tmp_path / "run", steps=3, checkpoint_every=0, signal_at=1))  # stopped after step 2
    metrics = tmp_path / "run" / "metrics.jsonl"
    tr = FakeTrainer(tmp_path / "run", steps=4, start=2, checkpoint_every=0, signal_at=2)
    run(tr)  # scores step 2 (none recorded), stops after step 3
    tr = FakeTrainer(tmp_path / "run", steps=4, start=2, checkpoint_every=0)
    if case == "link":
        (tmp_path / "forged.jsonl").write_text(metrics.read_text())
        metrics.unlink()
        metrics.symlink_to(tmp_path / "forged.jsonl")
        with caplog.at_level(logging.WARNING, logger="esopt_mp.runner"):
            from esopt_mp.runfiles import RunFileError

            with pytest.raises(RunFileError):
                run(tr)
        assert "not read" in caplog.text and tr.calls == [("evaluate",)]
        return
    if case in ("not_a_number", "too_large"):
        bad = float("nan") if case == "not_a_number" else 10 ** 400
        rows = [dict(r, eval=bad) if r.get("eval_step") == 2 else r for r in _records(tmp_path / "run")]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif case == "infra":
        rows = _records(tmp_path / "run")
        at = next(i for i, r in enumerate(rows) if r.get("eval_step") == 2)
        rows.insert(at, {"eval_detail": {"failed": 1, "failures": {"model": 0, "wall_clock": 0, "infra": 1}}})
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        tr.reuses_held_out = False
    run(tr)
    assert tr.calls[0] == ("evaluate",)
    baseline = FakeTrainer(tmp_path / "run", steps=4, start=2, checkpoint_every=0)
    if case == "served":  # the same file, a trainer that may reuse: it does (the case above is the trainer's)
        run(baseline)
        assert baseline.calls[0] == ("step", 2)


def test_other_ranks_write_no_metrics_nor_plot(tmp_path):
    tr = FakeTrainer(tmp_path, steps=2, rank=1)
    assert run(tr)["steps"] == 2
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "training.png").exists()


def test_a_baselines_records_plot_with_their_kl(tmp_path):
    """The baselines' step records carry ``kl``, not ``sigma``: the plot shows it instead."""
    tr = FakeTrainer(tmp_path, steps=2, third="kl")
    run(tr)
    assert (tmp_path / "training.png").stat().st_size > 0


@pytest.mark.parametrize("summary,first", [({}, " ES run finished"), ({"algo": "grpo"}, " GRPO run finished")])
def test_the_summary_screen_names_the_algorithm(summary, first):
    s = dict(summary, steps=2, resumed_from=0, eval_before=0.25, eval_after=0.5, seconds=3.0, peak_rss_bytes=2**30,
             comm_bytes_per_step=8.0, params_local=10)
    lines = summary_screen(s).splitlines()
    assert lines[1].startswith(first) and f"{s.get('algo', 'es').upper()} comm / step" in lines[5]


def test_config_json_is_written_by_rank_0_only_and_rebuilds_the_run(tmp_path):
    cfg = build_config({"run": {"dir": str(tmp_path)}}, 1)
    identity = config_identity(cfg)
    write_config(cfg, 1, "/models/base", identity)
    assert not (tmp_path / "config.json").exists()
    write_config(cfg, 0, "/models/base", identity)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved.pop("base_model"), saved.pop("config_hash"), saved.pop("identity")) == \
        ("/models/base", config_hash(cfg), identity["fields"])
    assert config_hash(build_config(saved, 1)) == config_hash(cfg)


def test_a_baseline_run_dir_holding_a_foreign_checkpoint_is_refused_not_trained_over(tmp_path):
    """A stopped baseline run resumes from its checkpoint; a file there that is no checkpoint this version wrote is
    refused in one line before any model is loaded, not trained over from step 0
    (tests/integration/test_baselines_resume.py resumes real ones)."""
    import torch

    from esopt_mp.baseline_trainer import BaselineTrainer
    from esopt_mp.checkpoint import CheckpointError
    from esopt_mp.parallel import ParallelDims

    cfg = build_config({"run": {"dir": str(tmp_path)}, "algo": {"name": "grpo"}, "es": {"steps": 3},
                        "objective": {"name": "agent"}, "model": {"path": "builtin:tiny_agent"}}, 1)
    (tmp_path / "baseline").mkdir()
    torch.save({"step": 2, "model": {"w": torch.zeros(3)}}, tmp_path / "baseline" / "rank0.pt")
    with pytest.raises(CheckpointError, match=r"no checkpoint of rank 0 can be read \(.*rank0.pt: ValueError: not a "
                                              r"baseline checkpoint this version writes \(it has no config_hash, "
                                              r"layout, updates\)\): move run.dir/baseline aside"):
        BaselineTrainer(cfg, ParallelDims(1, 1, 1))


def test_the_run_start_record_is_on_disk_before_the_first_step(tmp_path, monkeypatch):
    """A rerun trusts a recorded score only if no later start says other weights reached its step: that record
    must outlive a power loss as the checkpoints after it do (fsynced, not left in the page cache)."""
    import esopt_mp.metrics as metrics_mod

    synced = []
    real = os.fsync

    def fsync(fd):  # os.fsync everywhere (metrics.os is os): only metrics.jsonl's are recorded, with its last line
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("metrics.jsonl"):
            with open(path) as f:
                synced.append(f.read().splitlines()[-1])
        real(fd)

    monkeypatch.setattr(metrics_mod.os, "fsync", fsync)
    tr = FakeTrainer(tmp_path, steps=2, eval_every=1)
    tr.step = lambda t, step=tr.step: (synced.append(("step", t)), step(t))[1]
    run(tr)
    assert synced[:2] == ['{"run_start": 0}', ("step", 0)] and synced.count('{"run_start": 0}') == 1
