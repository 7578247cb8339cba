"""The files a run writes into run.dir: a torn or zero-filled tail of an append-only log is cut before a resumed
run appends to it and never fails a reader; a symbolic link planted in run.dir is refused (or, for a file
replaced whole, replaced) and never written through."""
import json
import os

import pytest
import torch

from esopt_mp.config import build_config
from esopt_mp.identity import config_identity
from esopt_mp.ledger import Ledger
from esopt_mp.metrics import MetricsWriter, last_per_step, plot_run
from esopt_mp.parallel import ParallelDims

STEP = {"step": 0, "return_mean": 0.1, "return_max": 0.2, "sigma": 0.01, "rollout_s": 1.0, "step_s": 1.5}
TORN = {"partial line": b'{"step": 1, "retu', "zero-filled blocks": b"\0" * 4096,
        "line without its newline then zeros": b'{"step": 1}' + b"\0" * 100}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path, "rb").read().splitlines()]


def _outside(tmp_path):
    """A run.dir and, outside it, the file a planted link points at (holding a marker that must stay)."""
    run, target = tmp_path / "run", tmp_path / "outside.txt"
    run.mkdir()
    target.write_text("not the run's\n")
    return run, target


# ------------------------------------------------------------------ torn tails


@pytest.mark.parametrize("tail", TORN.values(), ids=TORN.keys())
def test_a_resumed_run_cuts_the_torn_tail_of_metrics_before_appending(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    MetricsWriter(str(path), 0).write({"eval_step": 0, "eval": 0.5})
    with open(path, "ab") as f:
        f.write(tail)  # the crash
    w = MetricsWriter(str(path), 0)  # the resumed run
    w.write({"eval_step": 2, "eval": 0.75})
    assert _lines(path) == [{"eval_step": 0, "eval": 0.5}, {"eval_step": 2, "eval": 0.75}]


def test_a_torn_line_in_metrics_never_fails_the_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as f:
        f.write(json.dumps({"eval_step": 0, "eval": 0.5}).encode() + b"\n" + json.dumps(STEP).encode() + b"\n" +
                b'{"step": 1, "ret{"step": 1}\n' +  # a record glued onto a torn line by a run without repair
                b"\0" * 64 + b'{"eval_step": 1, "eval": 0.6}\n' + b'{"eval_st')  # zeros, then the torn tail
    out = plot_run(str(path), str(tmp_path / "training.png"))
    assert out and os.path.getsize(out) > 0


def test_a_step_played_again_after_a_resume_is_drawn_once_in_step_order():
    rows = [{"step": 0, "r": "a"}, {"step": 1, "r": "a"}, {"step": 2, "r": "a"}, {"step": 1, "r": "b"},
            {"step": 2, "r": "b"}, {"eval": 0.5}]
    assert last_per_step(rows, "step") == [{"step": 0, "r": "a"}, {"step": 1, "r": "b"}, {"step": 2, "r": "b"}]


def test_a_resumed_run_cuts_the_torn_tail_of_trajectories(tmp_path):
    from esopt_mp.runfiles import trajectories_file

    cfg = build_config({"run": {"dir": str(tmp_path)}}, 1)
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(b'{"kind": "train", "ret": 1.0}\n{"kind": "tr')
    assert trajectories_file(cfg, 1) == str(path) and path.read_bytes().endswith(b'{"kind": "tr')  # rank 0 only
    assert trajectories_file(cfg, 0) == str(path)
    assert path.read_bytes() == b'{"kind": "train", "ret": 1.0}\n'


def test_the_tail_search_reads_back_past_long_lines_and_keeps_zero_prefixed_records():
    import io

    from esopt_mp.runfiles import complete_end

    long = json.dumps({"turns": "x" * 5000}).encode() + b"\n"
    for data, want in [(long + b'{"a', len(long)), (long * 3 + b"\0" * 300, 3 * len(long)),
                       (b'{"a": 1}\n\0\0{"b": 2}\n\0\0', 20), (b"\0" * 50, 0), (b"", 0), (b'{"a": 1}', 0)]:
        assert complete_end(io.BytesIO(data), len(data), block=64) == want, data[-20:]


def test_the_jsonl_reader_skips_lines_that_are_not_records(tmp_path, caplog):
    from esopt_mp.runfiles import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": 1}\n[1]\n\0\0{"b": 2}\n{"c": \n\n\0\0\0')
    assert read_jsonl(str(path)) == [{"a": 1}, {"b": 2}]
    assert "skipped 2 line(s)" in caplog.text


# ------------------------------------------------------------------ links planted in run.dir


def test_metrics_through_a_link_is_refused_naming_the_file(tmp_path):
    run, target = _outside(tmp_path)
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(RuntimeError, match=r"metrics\.jsonl is a symbolic link") as e:
        MetricsWriter(str(run / "metrics.jsonl"), 0).write(STEP)
    assert "\n" not in str(e.value) and target.read_text() == "not the run's\n"


def test_a_dangling_link_is_refused_not_created_through(tmp_path):
    run, _ = _outside(tmp_path)
    os.symlink(tmp_path / "new.txt", run / "metrics.jsonl")
    with pytest.raises(RuntimeError, match="symbolic link"):
        MetricsWriter(str(run / "metrics.jsonl"), 0).write(STEP)
    assert not (tmp_path / "new.txt").exists()


def test_the_ledger_through_a_link_is_refused(tmp_path):
    run, target = _outside(tmp_path)
    os.symlink(target, run / "history.jsonl")
    with pytest.raises(RuntimeError, match=r"history\.jsonl is a symbolic link"):
        Ledger(str(run), "h", 0).append({"step": 0, "seeds": [1], "weights": [1.0], "alpha": 0.1})
    assert target.read_text() == "not the run's\n"


def test_trajectories_through_a_link_are_refused(tmp_path):
    from esopt_mp.agent.loop import write_trajectories

    run, target = _outside(tmp_path)
    os.symlink(target, run / "trajectories.jsonl")
    with pytest.raises(RuntimeError, match=r"trajectories\.jsonl is a symbolic link"):
        write_trajectories(str(run / "trajectories.jsonl"), [])
    assert target.read_text() == "not the run's\n"


def test_config_json_and_the_plot_replace_a_link_instead_of_writing_through_it(tmp_path):
    from esopt_mp.runfiles import write_config

    run, target = _outside(tmp_path)
    os.symlink(target, run / "config.json")
    os.symlink(target, run / "training.png")
    cfg = build_config({"run": {"dir": str(run)}}, 1)
    write_config(cfg, 0, "/models/base", config_identity(cfg))
    (run / "metrics.jsonl").write_text(json.dumps(STEP) + "\n")
    plot_run(str(run / "metrics.jsonl"), str(run / "training.png"))
    assert target.read_text() == "not the run's\n"
    assert not os.path.islink(run / "config.json") and json.loads((run / "config.json").read_text())["base_model"]
    assert not os.path.islink(run / "training.png") and (run / "training.png").read_bytes()[:4] == b"\x89PNG"


def test_an_atomic_write_never_opens_a_link_planted_at_its_temporary_name(tmp_path):
    from esopt_mp.runfiles import write_atomic

    run, target = _outside(tmp_path)
    os.symlink(target, f"{run / 'config.json'}.tmp{os.getpid()}")
    write_atomic(str(run / "config.json"), "{}")
    assert target.read_text() == "not the run's\n" and (run / "config.json").read_text() == "{}"
    assert os.listdir(run) == ["config.json"]


def _perturber():
    from esopt_mp.es import Perturber
    from esopt_mp.es.shard import LocalShard, ShardInfo

    return Perturber([LocalShard(torch.arange(4.0), ShardInfo("w", (4,), (0,), (4,)))])


def test_checkpoints_are_never_written_through_a_link(tmp_path):
    from esopt_mp import checkpoint as ck

    run, _ = _outside(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "ckpt")
    with pytest.raises(RuntimeError, match=r"ckpt is a symbolic link"):
        ck.save_checkpoint(str(run), 1, _perturber(), ParallelDims(1, 1, 1))
    assert os.listdir(elsewhere) == []
    os.unlink(run / "ckpt")
    (run / "ckpt").mkdir()
    os.symlink(elsewhere, run / "ckpt" / "step_000001.tmp")  # where the save writes before its rename
    ck.save_checkpoint(str(run), 1, _perturber(), ParallelDims(1, 1, 1))
    assert os.listdir(elsewhere) == [] and os.listdir(run / "ckpt") == ["step_000001"]
    assert not os.path.islink(run / "ckpt" / "step_000001")


def test_the_context_folder_and_skill_log_through_links_are_refused(tmp_path):
    from esopt_mp.prompt.base import ContextStore
    from esopt_mp.prompt.skill import SkillSynthesis

    run, target = _outside(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "contexts")
    with pytest.raises(RuntimeError, match=r"contexts is a symbolic link"):
        ContextStore(str(run)).put("## Skill\n")
    assert os.listdir(elsewhere) == []
    os.symlink(target, run / "skill.jsonl")
    skill = SkillSynthesis(lambda *a: "", lambda *a: 0.0, log_path=str(run / "skill.jsonl"))
    with pytest.raises(RuntimeError, match=r"skill\.jsonl is a symbolic link"):
        skill._write({"step": 0})
    assert target.read_text() == "not the run's\n"


def test_a_start_refuses_a_run_dir_holding_a_link_where_the_run_writes(tmp_path):
    from esopt_mp.startup import check_run_dir

    run, target = _outside(tmp_path)
    check_run_dir(str(run))
    os.symlink(target, run / "notes.txt")  # not a name the run writes: left alone
    check_run_dir(str(run))
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(RuntimeError, match=r"metrics\.jsonl is a symbolic link"):
        check_run_dir(str(run))
    with pytest.raises(RuntimeError, match=r"metrics\.jsonl is a symbolic link"):
        check_run_dir(str(run), create=False)  # the dry run says so too


def test_an_export_replaces_a_link_at_its_folder(tmp_path):
    from esopt_mp.runfiles import fresh_dir, remove_path

    run, _ = _outside(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    os.symlink(elsewhere, run / "export")
    os.symlink(elsewhere, run / "export.tmp")
    tmp = fresh_dir(str(run / "export.tmp"))
    (run / "export.tmp" / "config.json").write_text("{}")
    remove_path(str(run / "export"))
    os.replace(tmp, run / "export")
    assert os.listdir(elsewhere) == ["keep"] and os.listdir(run / "export") == ["config.json"]


def test_a_fifo_or_folder_where_a_run_file_goes_is_refused_not_waited_on(tmp_path):
    from esopt_mp.runfiles import RunFileError, open_run_file, repair_jsonl

    fifo, folder = tmp_path / "metrics.jsonl", tmp_path / "history.jsonl"
    os.mkfifo(fifo)
    folder.mkdir()
    for path in (fifo, folder):
        for mode in ("rb", "a"):
            with pytest.raises(RunFileError, match="is not a regular file"):
                open_run_file(str(path), mode)
    with pytest.raises(RunFileError, match="is not a regular file"):
        repair_jsonl(str(fifo))


def test_the_run_files_former_home_names_them_with_a_notice():
    import esopt_mp.runfiles as runfiles
    import esopt_mp.runner as runner

    with pytest.warns(DeprecationWarning, match=r"^esopt_mp.runner.write_config is now esopt_mp.runfiles.write_config"):
        assert runner.write_config is runfiles.write_config
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        runner.nope
