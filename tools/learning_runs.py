"""What a learning benchmark run left in its run dir: whether it finished, its held-out curve, its row of the report
(wall time and peak RSS over all its processes, drift from the start weights) and its final weights."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finished(run_dir: str) -> dict | None:
    """The summary of a finished run in ``run_dir``, else None."""
    from esopt_mp.runfiles import read_jsonl

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = list(read_jsonl(path))
    return rows[-1]["summary"] if rows and "summary" in rows[-1] else None


def curve_of(rows: list[dict], n_per_step: int, success: str = "mean", where: str = "run") -> list[list]:
    """[[training episodes, held-out success], ...] from a run's metrics rows. ``success``: ``mean`` (the mean
    held-out return: the tasks that score 0 or 1) or ``full`` (the share of held-out episodes with full marks, a
    win, where the game also scores partial credit: the ``eval_detail`` row each evaluation writes just before its
    result). A run restarted in its directory appends: the last series (from the last evaluation at step 0) counts,
    and an evaluation repeated at a resume counts once."""
    points, detail = {}, None
    for r in rows:
        if "eval_detail" in r:
            detail = r["eval_detail"]
        elif "eval" in r and "eval_step" in r:
            step = int(r["eval_step"])
            if success == "mean":
                value = float(r["eval"])
            elif detail is None or success not in detail:
                raise ValueError(f"{where}: the evaluation at step {step} has no '{success}' in the eval_detail row "
                                 "before it (a run made before that figure was recorded: run it again)")
            else:
                value = float(detail[success])
            if step == 0:
                points = {}
            points[step] = value
            detail = None
    return [[step * n_per_step, v] for step, v in sorted(points.items())]


def result(method: str, seed: int, run_dir: str, n_per_step: int, wall_s: float | None,
           maxrss: int | None, start_dir: str | None, success: str = "mean", kept: dict | None = None,
           how: dict | None = None) -> dict:
    """A finished run's row. ``wall_s``/``maxrss``: of the process that has just finished it (its earlier,
    stopped processes are added), ``how`` what it ran with (commit, threads, jobs: see ``measured_with``); None
    when the run is read back: its ``bench_run.json``, else ``kept`` (an earlier report's row of a run that
    finished before that file was written)."""
    from esopt_mp.runfiles import read_jsonl

    rows = list(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
    summary = rows[-1]["summary"]
    measured = os.path.join(run_dir, "bench_run.json")  # the run's wall time and peak RSS, kept for read-backs
    earlier = launches(run_dir)  # a run stopped and resumed: its earlier processes count too
    if wall_s is not None:
        wall_s, maxrss = wall_s + sum(e["wall_s"] for e in earlier), max([maxrss or 0] + [e["peak_rss_bytes"] or 0
                                                                                        for e in earlier]) or None
        with_ = measured_with([e.get("how") for e in earlier] + [how])
        write_atomic_json(measured, {"wall_s": wall_s, "peak_rss_bytes": maxrss, "processes": len(earlier) + 1,
                                     **({"measured_with": with_} if with_ else {})})
    else:
        if os.path.exists(measured):
            with open(measured) as f:
                kept = json.load(f)
        wall_s, maxrss, with_ = ((kept or {}).get(k) for k in ("wall_s", "peak_rss_bytes", "measured_with"))
    # the start and the end from the curves, whatever step a resumed run began at (its summary starts there)
    curve, returns = curve_of(rows, n_per_step, success, run_dir), curve_of(rows, n_per_step)
    before, after = curve[0][1], curve[-1][1]
    out = {"method": method, "seed": seed, "run_dir": os.path.relpath(run_dir, ROOT), "curve": curve,
           "success": success, "before": before, "after": after, "delta": after - before,
           "return_before": returns[0][1], "return_after": returns[-1][1], "steps": summary["steps"],
           "episodes": summary["steps"] * n_per_step,
           # one process: its time from its first evaluation on; several: their whole wall time (each one's start
           # included, and a resume's evaluation where it could not reuse a recorded score)
           "train_seconds": summary["seconds"] if not earlier else wall_s, "processes": len(earlier) + 1,
           "wall_s": wall_s, "peak_rss_bytes": maxrss or summary.get("peak_rss_bytes"),
           "peak_gpu_bytes": summary.get("peak_gpu_bytes"), **({"measured_with": with_} if with_ else {})}
    export = end_weights(run_dir, start_dir) if start_dir else None
    if export is not None:
        cached = os.path.join(run_dir, "drift.json")
        try:
            if not os.path.exists(cached):
                from esopt_mp.drift import drift

                write_atomic_json(cached, drift(start_dir, export))
            with open(cached) as f:
                out["drift"] = json.load(f)
        except Exception as e:  # noqa: BLE001 - a report without drift beats none; rerunning fills it in
            print(f"[bench_learning] {method} seed {seed}: no drift ({type(e).__name__}: {e})", file=sys.stderr)
    return out


def measured_with(hows: list) -> dict:
    """What a run's processes ran with, a key at a time: one value where every process says the same, else each
    process's in order, None for one that did not say (stopped under an older version: ``[None, 2]``)."""
    hows = [h if isinstance(h, dict) else {} for h in hows]
    if not any(hows):
        return {}
    keys = dict.fromkeys(k for h in hows for k in h)
    return {k: vals[0] if len(set(map(json.dumps, vals))) == 1 else vals
            for k in keys for vals in [[h.get(k) for h in hows]]}


def launches(run_dir: str) -> list[dict]:
    """The earlier processes of a run that was stopped (or failed) and relaunched: each one's wall time, peak RSS,
    exit status and what it ran with (``how``)."""
    path = os.path.join(run_dir, "bench_launches.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def end_weights(run_dir: str, start_dir: str):
    """A run's final weights: its export (ES), else the start model with the baseline checkpoint's weights loaded
    (GRPO and PPO runs write ``baseline/rank0.pt``, no export); None if neither is there."""
    export = os.path.join(run_dir, "export")
    if os.path.isdir(export):
        return export
    ckpt = os.path.join(run_dir, "baseline", "rank0.pt")
    if not os.path.exists(ckpt):
        return None
    import torch

    from esopt_mp.drift import load_fp32_model

    model = load_fp32_model(start_dir)
    model.load_state_dict(torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)["model"])
    return model


def write_atomic_json(path: str, data) -> None:
    from esopt_mp.runfiles import write_atomic

    write_atomic(path, json.dumps(data, indent=1).encode())
