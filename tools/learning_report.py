"""The learning benchmark's report: per method the seeds' summary (:func:`table`), and the plot of held-out
success over played episodes with the seeds' range (:func:`plot`)."""
from __future__ import annotations

import json


def _mean(values: list) -> float | None:
    """The mean of the values that were measured (None: a run finished by a process this benchmark did not see)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def table(results: list[dict]) -> dict[str, dict]:
    """Per method: the seeds' start and end, their mean, the smallest gain, whether every seed went up."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in results):
        rs = [r for r in results if r["method"] == m and "after" in r]
        if not rs:
            out[m] = {"runs": 0}
            continue
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        row = {"runs": len(rs), "episodes": rs[0]["episodes"], "mean_before": mean("before"),
               "mean_after": mean("after"), "mean_delta": mean("delta"), "min_delta": min(r["delta"] for r in rs),
               "every_seed_up": all(r["delta"] > 0 for r in rs),
               "mean_train_seconds": _mean([r["train_seconds"] for r in rs]),
               "max_peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in rs)}
        drifts = [r["drift"] for r in rs if "drift" in r]
        if drifts:
            for k in ("offtask_nll_delta", "update_norm", "relative_update_norm"):
                row[f"mean_{k}"] = sum(d[k] for d in drifts) / len(drifts)
        out[m] = row
    return out


COLOURS = {"es": "tab:blue", "grpo": "tab:orange", "ppo": "tab:green", "es-anchored": "tab:purple",
           "es-lowrank": "tab:red"}


def band(curves: list[list]) -> tuple[list, list, list, list]:
    """The seeds' mean, lowest and highest held-out score at the episode counts every seed was evaluated at (a
    resumed run adds a point where it restarted; one seed's point is never averaged with another count's)."""
    xs = sorted(set.intersection(*({x for x, _ in c} for c in curves)))
    ys = [[dict(map(tuple, c))[x] for c in curves] for x in xs]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot(reports: list[dict], png: str) -> str:
    """One panel per report: each method's mean held-out curve over episodes, the seeds' range shaded."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(reports), 4.0))
    axes = fig.subplots(1, len(reports), squeeze=False)[0]
    for ax, rep in zip(axes, reports):
        for m in dict.fromkeys(r["method"] for r in rep["runs"]):
            curves = [r["curve"] for r in rep["runs"] if r["method"] == m and r.get("curve")]
            if not curves:
                continue
            xs, mean, low, high = band(curves)
            ax.plot(xs, mean, "o-", color=COLOURS.get(m), label=f"{m.upper()} "
                    f"({len(curves)} seed{'s, mean' if len(curves) > 1 else ''})")
            ax.fill_between(xs, low, high, color=COLOURS.get(m), alpha=0.15)
        ax.set_title(f"{rep['task']}: {rep.get('model') or 'tiny agent'}", fontsize=9)
        ax.set_xlabel("training episodes played")
        full = any(r.get("success") == "full" for r in rep["runs"])
        ax.set_ylabel("held-out games won" if full else "held-out success")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no finished run yet: an empty panel, no legend
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def read_report(path: str, option: str, plan: bool = False) -> dict:
    """The benchmark report at ``path`` (its runs a list of runs, its task named, and with ``plan`` its plan a
    mapping of methods); a file that is not one is refused in one line naming ``option``."""
    try:
        with open(path) as f:
            rep = json.load(f)
        runs = rep["runs"]
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise TypeError("'runs' must be a list of runs")
        if plan and not isinstance(rep["plan"], dict):
            raise TypeError("'plan' must be a mapping of methods")
        if "task" not in rep:
            raise KeyError("task")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {option} {path}: not a learning benchmark report ({type(e).__name__}: {e})")
    return rep
