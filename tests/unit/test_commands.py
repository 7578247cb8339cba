"""``esopt``: the verbs, a misspelt one, and a verb running its script in this process with its own exit status."""
import json
import signal
import sys
import tomllib
from pathlib import Path

from esopt_mp.commands import ROOT, VERBS, main


def test_the_console_script_is_declared_and_every_verb_has_its_script_or_function():
    import importlib

    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["esopt"] == "esopt_mp.commands:main"
    for verb, (target, _) in VERBS.items():
        if ":" in target:
            module, _, func = target.partition(":")
            assert callable(getattr(importlib.import_module(module), func)), verb
        else:
            assert (Path(ROOT) / target).is_file(), verb


def test_usage_lists_the_verbs_and_a_misspelt_one_is_one_line(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(f"  {v} " in out for v in VERBS)
    assert main(["tran", "x=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'tran' (did you mean 'train'?)" in err[0]


def test_a_verb_runs_its_script_with_its_exit_status_and_restores_the_process(capsys, tmp_path):
    argv, main_module = list(sys.argv), sys.modules["__main__"]
    assert main(["replay", "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("esopt replay: error: ") and "no such run directory" in err and len(err.splitlines()) == 1
    assert sys.argv == argv and sys.modules["__main__"] is main_module
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)]
    assert main(["train", "--help"]) == 0
    assert "usage:" in capsys.readouterr().out
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)] == handlers  # its stop handler undone
    assert main(["envs", "list"]) == 0
    assert "sudoku" in json.loads(capsys.readouterr().out)["builtin"]


def test_bench_runs_one_benchmark_by_name_and_lists_them(capsys):
    from esopt_mp.commands import BENCHMARKS

    for name, (script, _) in BENCHMARKS.items():
        assert (Path(ROOT) / script).is_file(), name
    assert main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {n} " in out for n in BENCHMARKS)
    assert main(["bench", "lerning"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown benchmark 'lerning' (did you mean 'learning'?)" in err[0]
    assert main(["bench", "learning", "--help"]) == 0
    assert "--methods" in capsys.readouterr().out
    assert main(["bench-learning", "--help"]) == 0  # the old spelling: the same, with a one-line notice
    cap = capsys.readouterr()
    assert "--methods" in cap.out and cap.err.startswith("note: 'esopt bench-learning' is now 'esopt bench learning'")


def test_a_benchmark_record_names_the_command_as_typed(capsys, monkeypatch):
    import os

    from esopt_mp.profiling.record import bench_record, print_record

    rec = bench_record("x", {"a": 1}, ["/somewhere/tools/bench_x.py", "--quick"])
    assert set(rec) == {"benchmark", "command", "machine", "versions", "figures"}
    assert rec["figures"] == {"a": 1} and rec["command"].endswith("bench_x.py --quick")
    assert rec["versions"]["torch"] and rec["machine"]["cpus_usable"] >= 1
    monkeypatch.setenv("ESOPT_PROG", "esopt bench x")
    monkeypatch.setattr(sys, "argv", ["tools/bench_x.py", "--quick"])
    assert print_record("x", {"a": 1})["command"] == "esopt bench x --quick"
    assert json.loads(capsys.readouterr().out)["command"] == "esopt bench x --quick"
    monkeypatch.delenv("ESOPT_PROG")
    assert "ESOPT_PROG" not in os.environ


def test_the_records_commit_is_read_from_a_checkout_a_worktree_and_packed_refs(tmp_path, monkeypatch):
    from esopt_mp.profiling import record

    main, wt = tmp_path / "main", tmp_path / "wt"
    git = main / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("a" * 40 + "\n")
    monkeypatch.setattr(record, "ROOT", str(main))
    assert record.git_commit() == "a" * 40
    own = git / "worktrees" / "wt"  # a worktree on a branch whose ref git gc packed
    own.mkdir(parents=True)
    (own / "HEAD").write_text("ref: refs/heads/topic\n")
    (own / "commondir").write_text("../..\n")
    (git / "packed-refs").write_text("# pack-refs with: peeled\n" + "b" * 40 + " refs/heads/topic\n")
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {own}\n")
    monkeypatch.setattr(record, "ROOT", str(wt))
    assert record.git_commit() == "b" * 40
    (own / "HEAD").write_text("c" * 40 + "\n")  # detached
    assert record.git_commit() == "c" * 40
    monkeypatch.setattr(record, "ROOT", str(tmp_path))  # not a checkout
    assert record.git_commit() is None
