"""tools/bench_learning.py gives every method the same budget of played episodes and summarises what its runs did."""
import argparse
import json

import pytest

from tools import bench_learning as bl
from tools import learning_report, learning_runs as lr
from tools.learning_tasks import SMOLLM2


@pytest.mark.parametrize("episodes", [256, 512])
def test_every_method_plays_the_same_number_of_training_episodes(episodes):
    pytest.importorskip("reasoning_gym")
    todo = bl.plan("arith", ["es", "grpo", "ppo"], episodes, [])
    assert {m: t["episodes"] for m, t in todo.items()} == {"es": episodes, "grpo": episodes, "ppo": episodes}
    for m, t in todo.items():
        cfg = bl.compose(t["argv"])
        steps = cfg["es"]["steps"] if m == "es" else cfg["algo"]["steps"]
        assert steps == t["steps"] and steps * bl.per_step(m, cfg) == episodes
        assert cfg["algo"]["name"] == m and cfg["model"]["path"] == SMOLLM2
        assert cfg["env"]["reasoning_gym"]["answer_format"] == "lenient"


def test_overrides_after_the_task_s_win_and_change_the_budget_arithmetic():
    pytest.importorskip("reasoning_gym")
    todo = bl.plan("arith", ["es"], 512, ["es.population=16"])
    assert todo["es"]["episodes_per_step"] == 16 * 8 and todo["es"]["steps"] == 4


def _run(method, seed, before, after, curve_after):
    return {"method": method, "seed": seed, "before": before, "after": after, "delta": after - before,
            "episodes": 64, "train_seconds": 10.0, "peak_rss_bytes": 2 ** 30,
            "curve": [[0, before], [32, (before + curve_after) / 2], [64, curve_after]],
            "drift": {"offtask_nll_delta": 0.01, "update_norm": 2.0, "relative_update_norm": 0.001}}


def test_the_table_reports_the_mean_the_smallest_gain_and_whether_every_seed_rose(tmp_path):
    runs = [_run("es", 0, 0.2, 0.3, 0.3), _run("es", 1, 0.2, 0.25, 0.25), _run("grpo", 0, 0.2, 0.1, 0.1),
            {"method": "ppo", "seed": 0, "failed": 1}]
    t = bl.table(runs)
    assert t["es"]["mean_delta"] == pytest.approx(0.075) and t["es"]["min_delta"] == pytest.approx(0.05)
    assert t["es"]["every_seed_up"] and not t["grpo"]["every_seed_up"] and t["ppo"] == {"runs": 0}
    assert t["es"]["mean_update_norm"] == 2.0
    png = bl.plot([{"task": "arith", "model": SMOLLM2, "runs": runs}], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000 and png.endswith("p.png")
    json.dumps(t)  # the report is JSON


def test_a_run_s_final_weights_are_its_export_else_none_without_a_checkpoint(tmp_path):
    (tmp_path / "es" / "export").mkdir(parents=True)
    assert lr.end_weights(str(tmp_path / "es"), "unused") == str(tmp_path / "es" / "export")
    (tmp_path / "grpo").mkdir()
    assert lr.end_weights(str(tmp_path / "grpo"), "unused") is None


def test_success_is_the_mean_return_or_the_share_of_full_marks_of_the_same_eval():
    detail = lambda full: {"eval_detail": {"k": 1, "full": full}}  # noqa: E731
    rows = [detail(0.1), {"eval_step": 0, "eval": 0.6}, {"step": 0, "return_mean": 0.5},
            detail(0.3), {"eval_step": 4, "eval": 0.7}, {"summary": {}}]
    assert lr.curve_of(rows, 64) == [[0, 0.6], [256, 0.7]]
    assert lr.curve_of(rows, 64, "full") == [[0, 0.1], [256, 0.3]]
    # a resume re-evaluates at its start step (counted once); a run restarted from 0 in its directory: the last
    # series counts
    resumed = rows[:-1] + [detail(0.3), {"eval_step": 4, "eval": 0.7}, detail(0.5), {"eval_step": 8, "eval": 0.9}]
    assert lr.curve_of(resumed, 64, "full") == [[0, 0.1], [256, 0.3], [512, 0.5]]
    restarted = rows[:-1] + [detail(0.2), {"eval_step": 0, "eval": 0.65}, detail(0.4), {"eval_step": 8, "eval": 1.0}]
    assert lr.curve_of(restarted, 64) == [[0, 0.65], [512, 1.0]]
    with pytest.raises(ValueError, match=r"^runs/x: the evaluation at step 0 has no 'full'"):
        lr.curve_of([{"eval_detail": {"k": 1}}, {"eval_step": 0, "eval": 0.6}], 64, "full", "runs/x")


def test_the_game_task_plays_the_same_budget_within_the_game_s_own_turn_limit():
    pytest.importorskip("textarena")
    todo = bl.plan("guess", ["es", "grpo"], None, [])
    assert todo["es"]["episodes"] == todo["grpo"]["episodes"] == 512
    cfg = bl.compose(todo["es"]["argv"])
    assert cfg["env"]["name"] == "textarena" and cfg["env"]["max_turns"] == 5
    assert cfg["env"]["textarena"]["game_kwargs"]["max_turns"] == 5  # the game tells the player 5 turns


def test_a_resumed_run_s_start_is_its_first_evaluation_not_its_summary_s(tmp_path):
    """A run resumed at step 4 writes a summary whose eval_before is step 4's; start and end come from the curve."""
    detail = lambda full: {"eval_detail": {"k": 1, "full": full}}  # noqa: E731
    rows = [detail(0.1), {"eval_step": 0, "eval": 0.6}, detail(0.3), {"eval_step": 4, "eval": 0.7},
            detail(0.5), {"eval_step": 8, "eval": 0.9},
            {"summary": {"eval_before": 0.7, "eval_after": 0.9, "steps": 8, "seconds": 1.0}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = lr.result("es", 0, str(tmp_path), 64, 5.0, 2 ** 30, None, "full")
    assert (got["before"], got["after"], got["delta"]) == (0.1, 0.5, 0.5 - 0.1)
    assert (got["return_before"], got["return_after"]) == (0.6, 0.9)
    assert (got["wall_s"], got["peak_rss_bytes"]) == (5.0, 2 ** 30)  # one process: its own figures
    # stopped once after its checkpoint and relaunched: the wall time and peak RSS cover both processes
    first, second = {"git_commit": "a" * 40, "threads_per_run": 1, "jobs": 2}, {"git_commit": "a" * 40,
                                                                                 "threads_per_run": 2, "jobs": 1}
    (tmp_path / "bench_launches.json").write_text(json.dumps([{"wall_s": 7.0, "peak_rss_bytes": 2 ** 31, "exit": 75,
                                                               "how": first}]))
    got = lr.result("es", 0, str(tmp_path), 64, 5.0, 2 ** 30, None, "full", how=second)
    assert (got["wall_s"], got["peak_rss_bytes"], got["train_seconds"], got["processes"]) == (12.0, 2 ** 31, 12.0, 2)
    # what each process ran with: one value where they agree, both in order where they do not
    assert got["measured_with"] == {"git_commit": "a" * 40, "threads_per_run": [1, 2], "jobs": [2, 1]}
    kept = json.loads((tmp_path / "bench_run.json").read_text())
    assert kept == {"wall_s": 12.0, "peak_rss_bytes": 2 ** 31, "processes": 2, "measured_with": got["measured_with"]}
    for _ in range(2):  # read back (a later command, a --report-only): as kept, however often, whatever the
        # earlier report said
        again = lr.result("es", 0, str(tmp_path), 64, None, None, None, "full", kept={"wall_s": 99.0})
        assert (again["wall_s"], again["peak_rss_bytes"], again["train_seconds"]) == (12.0, 2 ** 31, 12.0)
        assert again["measured_with"] == got["measured_with"]
    # a process that did not say (stopped under an older version) is None in each list, not left out
    assert lr.measured_with([{"wall_s": 1.0}.get("how"), second, "bad"]) == {
        "git_commit": [None, "a" * 40, None], "threads_per_run": [None, 2, None], "jobs": [None, 1, None]}
    assert lr.measured_with([None, None]) == {} and lr.measured_with([second, second]) == second
    (tmp_path / "bench_run.json").unlink()  # a run that finished before its measurements were kept: the report's
    assert lr.result("es", 0, str(tmp_path), 64, None, None, None, "full", kept={"wall_s": 99.0})["wall_s"] == 99.0


@pytest.mark.parametrize("task", sorted(bl.TASKS))
def test_every_task_plans_every_method_as_a_run_that_would_start(task):
    """A planned run's config passes the checks a run makes (a profile's ES-only setting, such as common draws,
    must not reach a baseline), every method gets the task's budget, and the defaults a group file leaves to
    the dataclasses are filled in."""
    needs = {"arith": "reasoning_gym", "gcd": "reasoning_gym", "letters": "reasoning_gym",
             "products": "reasoning_gym", "gemma_arith": "reasoning_gym", "guess": "textarena", "guess10": "textarena"}
    if task in needs:
        pytest.importorskip(needs[task])
    todo = bl.plan(task, list(bl.METHODS), None, [])
    budgets = {t["episodes"] for t in todo.values()}
    assert len(budgets) == 1, todo
    cfgs = {m: bl.compose(t["argv"]) for m, t in todo.items()}
    for m, t in todo.items():
        assert cfgs[m]["algo"]["name"] == bl.algo_of(m) and t["steps"] * bl.per_step(m, cfgs[m]) == t["episodes"]
    if task == "guess10":  # its ES is the low-rank, batched one under either name
        es = cfgs["es"]["es"]
        assert es == cfgs["es-lowrank"]["es"] and es["noise"] == "lowrank" and es["member_batch"]


def test_the_seeds_band_uses_only_the_points_every_seed_was_evaluated_at():
    """A resumed run is evaluated where it restarted too: its extra point is not averaged with another seed's."""
    resumed = [[0, 0.2], [512, 0.6], [640, 0.64], [1024, 0.7]]
    xs, mean, low, high = learning_report.band([resumed, [[0, 0.3], [512, 0.4], [1024, 0.9]]])
    assert xs == [0, 512, 1024]
    assert mean == pytest.approx([0.25, 0.5, 0.8]) and low == [0.2, 0.4, 0.7] and high == [0.3, 0.6, 0.9]


def _report(path, task, argv, runs, commit=None):
    path.write_text(json.dumps({"task": task, "plan": {"grpo": {"argv": argv}}, "runs": runs,
                                "machine": {"git_commit": commit}, "threads_per_run": 1, "jobs": 2}))
    return str(path)


def test_included_runs_come_from_an_earlier_report_of_the_same_settings_where_no_run_dir_is_here(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "grpo-seed1").mkdir(parents=True)  # seed 1 has its own run dir here: that one counts
    argv = bl.plan("products", ["grpo"], None, [])["grpo"]["argv"]
    todo = {"grpo": {"argv": argv}}
    runs = [_run("grpo", s, 0.2, 0.5, 0.1) for s in (0, 1, 2)] + [{"method": "grpo", "seed": 3, "stopped": True}]
    # the same settings written otherwise: in another order, a number spelled otherwise, a run.* override
    lr = next(a for a in argv if a.startswith("algo.lr="))
    same = [a for a in argv if a != lr][::-1] + [f"algo.lr={float(lr.split('=')[1]):.10f}", "run.checkpoint_every=2"]
    rep = _report(tmp_path / "r.json", "products", same, runs, commit="0" * 40)
    args = argparse.Namespace(include=[rep], task="products", seeds=[0, 1, 3], out=str(out))
    got = bl.included(args, todo)
    assert [(m, s) for m, s, _ in got] == [("grpo", 0)]  # seed 2 not asked for, seed 3 never finished
    row = got[0][2]
    assert row["after"] == 0.5 and row["from_report"] == rep and row["measured_with"]["git_commit"] == "0" * 40
    assert "grpo seed 0: measured at commit 0000000000" in capsys.readouterr().err
    # that report's rows included again from a newer report: each names the commit it was measured at
    again = _report(tmp_path / "again.json", "products", same, [row], commit="1" * 40)
    assert bl.included(argparse.Namespace(**{**vars(args), "include": [again]}), todo)[0][2] == row
    assert "grpo seed 0: measured at commit 0000000000" in capsys.readouterr().err
    # a row that names what it ran with keeps it; what it does not name (or names None) comes from its report,
    # whose machine then does not contradict the row's commit
    own = {**runs[0], "measured_with": {"git_commit": ["2" * 40, None], "threads_per_run": [1, 2], "jobs": None}}
    mixed = _report(tmp_path / "mixed.json", "products", same, [own], commit="1" * 40)
    with_ = bl.included(argparse.Namespace(**{**vars(args), "include": [mixed]}), todo)[0][2]["measured_with"]
    assert with_ == {"git_commit": ["2" * 40, None], "threads_per_run": [1, 2], "jobs": 2, "machine": {}}
    own["measured_with"]["machine"] = {"git_commit": "3" * 40, "cpu_count": 2}  # the commit is said once
    mixed = _report(tmp_path / "mixed.json", "products", same, [own], commit="1" * 40)
    with_ = bl.included(argparse.Namespace(**{**vars(args), "include": [mixed]}), todo)[0][2]["measured_with"]
    assert with_["machine"] == {"cpu_count": 2} and with_["git_commit"] == ["2" * 40, None]
    assert "grpo seed 0: measured at commit 2222222222, ?" in capsys.readouterr().err
    bad = _report(tmp_path / "bad_commit.json", "products", same, [{**runs[0], "measured_with": {"git_commit": 7}}])
    with pytest.raises(SystemExit, match="a commit that is not a string: 7"):
        bl.included(argparse.Namespace(**{**vars(args), "include": [bad]}), todo)
    other = _report(tmp_path / "o.json", "products", [*argv, "algo.lr=3e-6"], runs)
    with pytest.raises(SystemExit, match=r"its grpo runs were played with other settings \(differing: algo.lr\)"):
        bl.included(argparse.Namespace(**{**vars(args), "include": [other]}), todo)
    seed = _report(tmp_path / "s.json", "products", [*argv, "run.seed=7"], runs)  # run.seed decides what it learns
    with pytest.raises(SystemExit, match=r"differing: run.seed\)"):
        bl.included(argparse.Namespace(**{**vars(args), "include": [seed]}), todo)
    task = _report(tmp_path / "t.json", "arith", argv, runs)
    with pytest.raises(SystemExit, match="a report of task 'arith', not 'products'"):
        bl.included(argparse.Namespace(**{**vars(args), "include": [task]}), todo)
    for bad in ("[1]", '{"runs": {"a": 1}, "plan": {}}', '{"runs": ["x"], "plan": {}}', '{"runs": [], "plan": []}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(SystemExit, match="not a learning benchmark report"):
            bl.included(argparse.Namespace(**{**vars(args), "include": [str(tmp_path / "bad.json")]}), todo)
    (tmp_path / "noplan.json").write_text(json.dumps({"task": "products", "plan": {}, "runs": runs}))
    with pytest.raises(SystemExit, match="it has a grpo run but no grpo plan"):
        bl.included(argparse.Namespace(**{**vars(args), "include": [str(tmp_path / "noplan.json")]}), todo)


def test_a_seed_override_is_refused_the_seeds_are_the_benchmark_s():
    with pytest.raises(SystemExit, match="run.seed is set per run by --seeds"):
        bl.plan("products", ["grpo"], None, ["run.seed=7"])


def test_a_budget_one_method_cannot_play_whole_is_refused_not_rounded():
    """ES plays 256 episodes a step on the default task, the baselines 32: 96 would give them unequal budgets."""
    with pytest.raises(SystemExit, match=r"^error: 96 training episodes is not a whole number of steps of every "
                                         r"method \(es: 256, grpo: 32 episodes a step\): give --episodes a multiple "
                                         r"of 256$"):
        bl.plan("default", ["es", "grpo"], 96, [])
    assert {m: t["episodes"] for m, t in bl.plan("default", ["es", "grpo"], 512, []).items()} == {"es": 512,
                                                                                                "grpo": 512}
