"""Does training make the agent better, and how does ES compare with GRPO and PPO at the same budget?

Runs each method (``es``, ``grpo``, ``ppo``, ``es-anchored``: ES whose weight decay pulls toward the starting
weights, ``es.decay_to=start``, and ``es-lowrank``: ES with rank-1 noise per matrix and each step's members
played in one batch, ``es.noise=lowrank es.member_batch=true``) on one (model, task) pair for several seeds, every
run given the same number of played training episodes, and writes one JSON report and one plot: held-out success
over episodes with the seeds' spread, each run's wall time and peak memory, and its drift (the change in
log-likelihood of a fixed off-task text set from the starting weights, and the update's norm).

    python tools/bench_learning.py                                  # ES on the embedded default, 3 seeds
    python tools/bench_learning.py --task arith --methods es grpo ppo --episodes 512 --jobs 2 --out bench/arith
    python tools/bench_learning.py --task arith --methods es -- es.sigma.start=2e-3   # Hydra overrides after --
    python tools/bench_learning.py --plot bench/arith/report.json bench/sudoku/report.json --png all.png

Each run is ``launch/train.py`` in its own process and run dir (``--out/<method>-seed<N>``) with
``ESOPT_THREADS=--threads``; a run dir whose run finished is read, not run again, and an unfinished one is
launched again and resumes from its checkpoint (add ``-- run.checkpoint_every=N``), so a stopped benchmark
continues where it was: SIGTERM to its runs makes each finish its step, save and exit, and the same command
later goes on (a run's wall time and peak RSS then cover all its processes, and its row's ``measured_with`` the
commit, ``--threads`` and ``--jobs`` each of them ran with). Held-out success is measured on the
task's held-out split, played as its profile says (greedily, or sampled with the same draws at every
evaluation): the mean held-out return for the tasks that score 0 or 1, the share of won games for a game that
also gives a lost one partial credit (a task's ``success``: ``full``). Held-out episodes are not counted in the
budget. A task's settings (model, environment, each method's hyperparameters) are in tools/learning_tasks.py;
overrides after ``--`` apply to every run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOPPED = 75  # launch/train.py's exit status for a run stopped (SIGTERM/SIGUSR1) after its checkpoint
sys.path.insert(0, ROOT)
from esopt_mp.profiling.record import bench_record, git_commit  # noqa: E402
from tools.learning_jobs import AlreadyRunning, Jobs  # noqa: E402
from tools.learning_report import plot, read_report, table  # noqa: E402
from tools.learning_runs import finished, launches, result, write_atomic_json  # noqa: E402
from tools.learning_tasks import LOWRANK, METHODS, TASKS  # noqa: E402


def algo_of(method: str) -> str:
    return method.split("-")[0]


def method_overrides(spec: dict, method: str) -> list[str]:
    if method == "es-anchored":
        return spec["methods"]["es"] + spec.get("anchor", ["es.decay_to=start", "es.weight_decay=10"])
    if method == "es-lowrank":
        return spec["methods"]["es"] + spec.get("lowrank", LOWRANK)
    return spec["methods"][method]


def per_step(method: str, cfg: dict) -> int:
    """Training episodes one step of ``method`` plays under the composed ``cfg``."""
    if algo_of(method) == "es":
        return int(cfg["es"]["population"]) * int(cfg["env"]["episodes_per_step"])
    return int(cfg["algo"]["tasks_per_step"]) * int(cfg["algo"]["generations"])


def compose(argv: list[str]) -> dict:
    """The run config ``launch/train.py argv`` would build, checked as a run checks it and with every default
    filled in (a group file writes only what differs from the dataclasses): a plan that no run could start is
    refused here, before any run is launched."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from esopt_mp.config import build_config, open_sections

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        data = OmegaConf.to_container(hydra_compose("config", overrides=open_sections(list(argv))), resolve=True)
    return build_config(data, 1).to_dict()


def plan(task: str, methods: list[str], episodes: int | None, extra: list[str]) -> dict[str, dict]:
    """Each method's overrides and step count for an equal budget of ``episodes`` training episodes."""
    spec = TASKS[task]
    if any(a.lstrip("+~").startswith("run.seed=") for a in extra):
        raise SystemExit("error: run.seed is set per run by --seeds; an override would give every run the same seed")
    budget = episodes or spec["episodes"]
    if not budget:  # the task's ES run as its profile sets it: every method then plays what ES plays
        cfg = compose(spec["overrides"] + method_overrides(spec, "es") + list(extra))
        budget = per_step("es", cfg) * int(cfg["es"]["steps"])
    argvs = {m: spec["overrides"] + method_overrides(spec, m) + ([] if algo_of(m) == "es" else [f"algo={m}"])
             + list(extra) for m in methods}
    sizes = {m: per_step(m, compose(argv)) for m, argv in argvs.items()}
    if any(budget % n for n in sizes.values()):  # a method playing fewer (or more) episodes would be no comparison
        raise SystemExit(f"error: {budget} training episodes is not a whole number of steps of every method "
                         f"({', '.join(f'{m}: {n}' for m, n in sizes.items())} episodes a step): give --episodes "
                         f"a multiple of {math.lcm(*sizes.values())}")
    out = {}
    for m, argv in argvs.items():
        n, steps = sizes[m], budget // sizes[m]
        out[m] = {"argv": argv + [f"es.steps={steps}"] + ([] if algo_of(m) == "es" else [f"algo.steps={steps}"]),
                  "steps": steps, "episodes_per_step": n, "episodes": steps * n}
    return out


def command(run_dir: str, argv: list[str], seed: int, evals: int, steps: int) -> list[str]:
    every = max(1, steps // max(1, evals))
    return [sys.executable, "launch/train.py", f"run.seed={seed}", f"run.dir={run_dir}", f"run.eval_every={every}",
            *argv]


def run_all(args, todo: dict[str, dict]) -> list[dict]:
    """Every (method, seed), ``args.jobs`` at a time; finished ones are read back. A SIGTERM, SIGINT or SIGHUP
    stops the runs after their step (see tools/learning_jobs.py); an error here stops them too, so none is left
    running on its own."""
    spec = TASKS[args.task]
    success = spec.get("success", "mean")
    start_dir = None
    if spec["model"]:
        from esopt_mp.models.gguf import converted_dir, is_gguf_source

        start_dir = converted_dir(spec["model"]) if is_gguf_source(spec["model"]) else spec["model"]
    earlier = {}  # an earlier report's measurements of runs that finished before bench_run.json was kept
    if os.path.exists(os.path.join(args.out, "report.json")):
        with open(os.path.join(args.out, "report.json")) as f:
            earlier = {(r["method"], r["seed"]): r for r in json.load(f).get("runs", []) if r.get("wall_s")}
    queue = [(m, s) for m in args.methods for s in args.seeds]  # a method's seeds first: its row fills first
    jobs, results = Jobs(), []
    for m, s, r in included(args, todo):  # runs an earlier report measured elsewhere, not in --out here
        results.append(r)
        queue.remove((m, s))
        print(f"[bench_learning] {m} seed {s}: from {r['from_report']}", file=sys.stderr)
    previous = {sig: signal.signal(sig, jobs.request_stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}  # under nohup a hangup stays ignored
    try:
        _play_all(args, todo, queue, jobs, results, start_dir, success, earlier)
    except BaseException:
        jobs.stop_all()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return results


# where a run writes and saves, its layout and launcher, a harness's server
IRRELEVANT = ("run", "parallel", "endpoint")


def _settings(argv: list[str]) -> dict:
    """What decides what a run learns: its config as this checkout composes it (its defaults, its environment),
    less the sections in IRRELEVANT but for ``run.seed``. Composed, so the overrides' order and spelling (``1e-5``
    or ``0.00001``) do not count; a default changed since the other report was made does not show."""
    from esopt_mp.typed import flatten

    cfg = compose(argv)
    return {**flatten({k: v for k, v in cfg.items() if k not in IRRELEVANT}), "run.seed": cfg["run"]["seed"]}


def _where(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def _same_settings(path: str, m: str, plan_m, mine: dict) -> None:
    """Refuse, in one line, report ``path``'s plan of method ``m`` unless it composes to the settings ``mine``."""
    if not isinstance(plan_m, dict) or not isinstance(plan_m.get("argv"), list):
        raise SystemExit(f"error: --include {path}: it has a {m} run but no {m} plan (its settings)")
    try:
        theirs = _settings([str(a) for a in plan_m["argv"]])
    except Exception as e:  # noqa: BLE001 - an override this checkout's configs do not know
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(f"error: --include {path}: its {m} settings do not compose here ({why})")
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise SystemExit(f"error: --include {path}: its {m} runs were played with other settings "
                         f"(differing: {', '.join(diff)})")


def included(args, todo: dict[str, dict]) -> list[tuple[str, int, dict]]:
    """From ``--include`` reports: each finished (method, seed) asked for whose run dir is not in ``--out`` (a run
    dir here wins), if its report played the same task with the same settings (composed configs compared; the
    code version is not: a report of another commit is named on stderr). Another task, other settings for a
    method asked for, or a file that is not such a report, is refused in one line (a table must not mix them).
    Each row keeps where and how it was measured (``from_report``, ``measured_with``)."""
    out, seen, ours = [], set(), {}
    commit = git_commit()
    for path in args.include or []:
        rep = read_report(path, "--include", plan=True)
        runs, plans = rep["runs"], rep["plan"]
        if rep.get("task") != args.task:
            raise SystemExit(f"error: --include {path}: a report of task {rep.get('task')!r}, not {args.task!r}")
        machine = rep.get("machine") if isinstance(rep.get("machine"), dict) else {}
        checked = set()  # this report's methods whose settings matched (composed once, not once per seed)
        for r in runs:
            m, s = r.get("method"), r.get("seed")
            if m not in todo or s not in args.seeds or "after" not in r or (m, s) in seen:
                continue
            if os.path.exists(os.path.join(args.out, f"{m}-seed{s}")):
                continue
            if m not in checked:
                if m not in ours:
                    ours[m] = _settings(todo[m]["argv"])
                _same_settings(path, m, plans.get(m), ours[m])
                checked.add(m)
            seen.add((m, s))
            with_ = _measured_with(r, rep, machine)
            at = with_["git_commit"] if isinstance(with_["git_commit"], list) else [with_["git_commit"]]
            if not all(c is None or isinstance(c, str) for c in at):
                raise SystemExit(f"error: --include {path}: not a learning benchmark report (a commit that is not a "
                                 f"string: {with_['git_commit']!r})")
            if commit and any(c and c != commit for c in at):
                print(f"[bench_learning] {m} seed {s}: measured at commit {', '.join(c[:10] if c else '?' for c in at)}"
                      f" ({path}), not this checkout's {commit[:10]}", file=sys.stderr)
            out.append((m, s, {**r, "from_report": r.get("from_report") or _where(path), "measured_with": with_}))
    return out


def _measured_with(r: dict, rep: dict, machine: dict) -> dict:
    """An included row's ``measured_with``: its own (a row included before, or one its run recorded), what it does
    not say from its report (that report's commit and machine, threads and jobs). The commit is said once, not
    again inside the machine."""
    own = r.get("measured_with")
    own = {k: v for k, v in own.items() if v is not None} if isinstance(own, dict) else {}
    fill = {"git_commit": machine.get("git_commit"), "threads_per_run": rep.get("threads_per_run"),
            "jobs": rep.get("jobs"), "machine": machine}
    with_ = {**fill, **own}
    if isinstance(with_["machine"], dict):
        with_["machine"] = {k: v for k, v in with_["machine"].items() if k != "git_commit"}
    return with_


def _play_all(args, todo, queue, jobs, results, start_dir, success, earlier) -> None:
    env = {**os.environ, "ESOPT_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    row = lambda m, s, run_dir, **kw: {"method": m, "seed": s, "run_dir": os.path.relpath(run_dir, ROOT), **kw}  # noqa
    read_back = lambda m, s, run_dir: result(m, s, run_dir, todo[m]["episodes_per_step"], None, None,  # noqa: E731
                                             start_dir, success, kept=earlier.get((m, s)))
    how = {"git_commit": git_commit(), "threads_per_run": args.threads, "jobs": args.jobs}  # each process's
    while (queue and not jobs.stopping) or jobs.running:
        while queue and not jobs.stopping and len(jobs.running) < args.jobs:
            m, s = queue.pop(0)
            run_dir = os.path.join(args.out, f"{m}-seed{s}")
            if finished(run_dir) is not None:
                results.append(read_back(m, s, run_dir))
                print(f"[bench_learning] {m} seed {s}: finished before, read back", file=sys.stderr)
                continue
            if args.report_only:
                print(f"[bench_learning] {m} seed {s}: not run (--report-only)", file=sys.stderr)
                continue
            try:
                if not jobs.start((m, s), run_dir, command(run_dir, todo[m]["argv"], s, args.evals, todo[m]["steps"]),
                                  ROOT, env):
                    queue.insert(0, (m, s))  # the stop came first
                    break
            except AlreadyRunning as e:
                print(f"[bench_learning] {m} seed {s}: not started: {e}", file=sys.stderr)
                results.append(row(m, s, run_dir, running=True))
                continue
            print(f"[bench_learning] {m} seed {s}: started ({todo[m]['steps']} steps of "
                  f"{todo[m]['episodes_per_step']} episodes), log {run_dir}/bench.log", file=sys.stderr)
        if not jobs.running:
            continue
        (m, s), run_dir, code, wall, rss, stopped = jobs.reap()
        if code != 0 or finished(run_dir) is None:
            write_atomic_json(os.path.join(run_dir, "bench_launches.json"), launches(run_dir) + [
                {"wall_s": wall, "peak_rss_bytes": rss, "exit": code, "how": how}])
            if stopped:
                print(f"[bench_learning] {m} seed {s}: stopped ({wall:.0f} s); the same command resumes it",
                      file=sys.stderr)
                results.append(row(m, s, run_dir, stopped=True))
                continue
            tail = open(os.path.join(run_dir, "bench.log"), errors="replace").read()[-2000:]
            print(f"[bench_learning] {m} seed {s} failed (exit {code}):\n{tail}", file=sys.stderr)
            results.append(row(m, s, run_dir, failed=code))
            continue
        r = result(m, s, run_dir, todo[m]["episodes_per_step"], wall, rss, start_dir, success, how=how)
        results.append(r)
        print(f"[bench_learning] {m} seed {s}: {r['before']:.3f} -> {r['after']:.3f} in {wall:.0f} s",
              file=sys.stderr)
    for m, s in queue if jobs.stopping else []:  # not started: the stop came first (a finished one is read back)
        run_dir = os.path.join(args.out, f"{m}-seed{s}")
        results.append(read_back(m, s, run_dir) if finished(run_dir) is not None else row(m, s, run_dir, stopped=True))


def _count(lowest: int):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {lowest}")
        return n
    return parse


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="default", choices=sorted(TASKS))
    ap.add_argument("--methods", nargs="+", default=["es"], choices=METHODS)
    ap.add_argument("--seeds", type=_count(0), nargs="+", default=[0, 1, 2])
    ap.add_argument("--episodes", type=_count(1), help="training episodes per run (default: the task's)")
    ap.add_argument("--evals", type=_count(1), default=4, help="held-out evaluations during a run (besides the first)")
    ap.add_argument("--jobs", type=_count(1), default=1, help="runs at once")
    ap.add_argument("--threads", type=_count(0), default=0, help="CPU threads per run (0: cores / jobs)")
    ap.add_argument("--out", help="the runs and the report (default: bench/learning-<task>)")
    ap.add_argument("--report-only", action="store_true", help="report the finished runs; start none")
    ap.add_argument("--include", nargs="+", metavar="REPORT",
                    help="take finished runs from earlier reports of the same task and settings (runs whose dirs "
                         "are gone or on another machine), for the seeds asked for that have no run dir in --out")
    ap.add_argument("--plot", nargs="+", metavar="REPORT", help="only plot these reports (one panel each)")
    ap.add_argument("--png", help="the plot's file (default: next to the report)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    if args.plot:
        reports = [read_report(p, "--plot") for p in args.plot]
        print(plot(reports, args.png or os.path.splitext(args.plot[0])[0] + ".png"))
        return
    args.seeds, args.methods = list(dict.fromkeys(args.seeds)), list(dict.fromkeys(args.methods))  # each once
    args.out = os.path.abspath(args.out or os.path.join(ROOT, "bench", f"learning-{args.task}"))
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    t0 = time.perf_counter()
    head = bench_record("learning", {})  # the command, machine, versions and commit the runs start with
    todo = plan(args.task, args.methods, args.episodes, args.overrides)
    results = run_all(args, todo)
    if args.report_only and not any("after" in r for r in results):
        raise SystemExit(f"error: nothing to report: no finished run of {' '.join(args.methods)}, seeds "
                         f"{' '.join(map(str, args.seeds))}, in {args.out}" + (" or --include" if args.include else ""))
    report = {"command": head["command"], "machine": head["machine"], "versions": head["versions"],
              "task": args.task, "about": TASKS[args.task]["about"], "model": TASKS[args.task]["model"],
              "plan": todo, "threads_per_run": args.threads, "jobs": args.jobs, "runs": results,
              "table": table(results), "wall_s": time.perf_counter() - t0}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    report["plot"] = plot([report], args.png or os.path.join(args.out, "report.png"))
    print(json.dumps({**head, "figures": {"report": path, "plot": report["plot"], "table": report["table"]}}))
    if any(r.get("failed") is not None or r.get("running") for r in results):
        sys.exit(1)  # a run failed, or another process still runs one: rerunning would not help by itself
    if any(r.get("stopped") for r in results):
        sys.exit(STOPPED)  # as a stopped run exits: rerun (or requeue) the same command to go on


if __name__ == "__main__":
    main()
