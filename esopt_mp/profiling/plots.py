"""The profiler's two figures: peaks per profile (device and host stacked) and one ES step over time."""
from __future__ import annotations

MIB = 2**20  # the unit of the profiler's tables
PHASE_COLORS = {"setup": "#dddddd", "perturb": "#f4a261", "rollouts": "#a8dadc", "restore": "#e76f51",
                "update": "#2a9d8f"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_chart(report: dict, path: str) -> str:
    """One bar per profile: device(-equivalent) peak, with the host part stacked on top."""
    plt = _plt()
    names = list(report["profiles"])
    cpu = not report["nvml"] and report["device"] == "cpu"
    dev = [report["profiles"][n]["device_peak_bytes"] / MIB for n in names]
    host_key = "host_by_design_bytes" if cpu else "host_peak_above_baseline_bytes"
    host = [report["profiles"][n][host_key] / MIB for n in names]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 4.5))
    ax.bar(names, dev, label="device-equivalent (RSS above baseline - host by design)" if cpu else "device peak")
    ax.bar(names, host, bottom=dev, label="host by design (snapshot / fp32 master)" if cpu else "host above baseline")
    for i, (d, h) in enumerate(zip(dev, host)):
        ax.text(i, d + h, f"{d:,.0f} + {h:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(top=max(d + h for d, h in zip(dev, host)) * 1.1 or 1)  # room for the labels
    m = report["model"]
    ax.set_ylabel("MiB per rank (device-equivalent + host)")
    ax.set_xlabel("profile (one training step each)")
    ax.set_title(f"Qwen3.5 {m['shape']} ({m['params'] / 1e9:.2f} B), tp={m['tp']}, "
                 f"batch {report['workload']['batch']}, context {report['workload']['context']}", fontsize=9)
    ax.legend(fontsize=8)
    plt.xticks(rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(raw: dict[str, dict], path: str) -> str:
    """Memory over one ES step, one panel per ES profile (rank 0), phases shaded."""
    plt = _plt()
    names = [n for n in raw if n.startswith("es_")] or list(raw)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        r = raw[name]
        tl, base = r["timeline"], r["baseline_bytes"]
        marks = [(t, p) for t, p in tl["marks"] if p != "load"]
        t_start = marks[0][0] if marks else 0.0
        ts = [t - t_start for t in tl["t"]]
        keep = [i for i, t in enumerate(ts) if t >= 0]
        ax.plot([ts[i] for i in keep], [(tl["host_rss"][i] - base) / MIB for i in keep], lw=1, color="k",
                label="host RSS above baseline")
        if tl.get("device"):
            ax.plot([ts[i] for i in keep], [tl["device"][i] / MIB for i in keep], lw=1, color="b", label="device")
        end = ts[-1] if ts else 0.0
        seen = set()
        for k, (t, p) in enumerate(marks):
            t1 = marks[k + 1][0] - t_start if k + 1 < len(marks) else end
            ax.axvspan(t - t_start, t1, color=PHASE_COLORS.get(p, "#eeeeee"), alpha=0.5,
                       label=None if p in seen else p)
            seen.add(p)
        ax.set_ylim(bottom=0)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, loc="lower right", ncol=3)
    axes[-1, 0].set_xlabel("seconds into the ES step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
