"""Bytes an ES step moves vs a gradient all-reduce of the same shard, counted and measured: one JSON object.

Each layout runs in a spawned gloo world (the tiny shipped agent, the agent
objective, so the TP channel's per-turn messages are included at tp > 1).
Around the measured ES steps, and then around one fp32 all-reduce of every
rank's local shard over its dp group (what a data-parallel gradient step
sends), two independent figures are taken:

- ``counted``: the bytes :class:`esopt_mp.parallel.Collectives` counted at its
  calls on every rank (sent, summed over ranks; per operation);
- ``kernel``: the loopback interface's transmitted bytes and packets from
  ``/proc/net/dev`` (``lo``), payload plus TCP/IP headers and ACKs. The run is
  re-executed in a private network namespace (``unshare --net``) when allowed,
  so no other process's traffic is counted (``lo_isolated``).

Usage: python tools/bench_comm.py [--steps 1] [--layouts 2x2,4x1]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from esopt_mp.profiling.record import print_record

import torch


def lo_counters() -> tuple[int, int]:
    """(tx bytes, tx packets) of the loopback interface."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                v = rest.split()
                return int(v[8]), int(v[9])
    raise RuntimeError("no 'lo' interface in /proc/net/dev")


def reexec_in_netns() -> None:
    """Re-run this command (``sys.argv``) in a private network namespace and exit with its status, so the
    loopback counters see only its own traffic; returns when already inside one or when not allowed."""
    if os.environ.get("ESOPT_BENCH_NETNS") is not None or not shutil.which("unshare"):
        return
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]
    if subprocess.run([*unshare, "ip", "link", "set", "lo", "up"], capture_output=True).returncode == 0:
        inner = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, sys.argv))}"
        env = dict(os.environ, ESOPT_BENCH_NETNS="1")
        sys.exit(subprocess.run([*unshare, "sh", "-c", inner], env=env).returncode)
    print("unshare --net is not allowed here; measuring on the shared loopback", file=sys.stderr)


def _worker(rank, world, dp, tp, steps, run_dir, out):
    from esopt_mp.config import build_config
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer

    cfg = build_config({
        "run": {"dir": run_dir, "trajectories": False}, "model": {"path": "builtin:tiny_agent"},
        "objective": {"name": "agent"}, "parallel": {"dp": dp, "tp": tp, "checksum_every": 1},
        "es": {"population": 4, "steps": steps},
        "env": {"name": "sudoku", "max_turns": 3, "n_train": 8, "n_eval": 2, "episodes_per_step": 2},
        "engine": {"temperature": 0.0, "max_new_tokens": 10},
    }, world)
    dims = init_distributed(discover(), dp, tp)
    trainer = ESTrainer(cfg, dims)
    comm = dims.comm
    shard = torch.randn(trainer.perturber.numel, dtype=torch.float32)  # a gradient of this rank's shard

    def measure(fn):
        comm.barrier()
        k0, c0 = lo_counters(), comm.stats.copy()
        comm.barrier()
        fn()
        comm.barrier()
        k1, c1 = lo_counters(), comm.stats.copy()
        return {"kernel": (k1[0] - k0[0], k1[1] - k0[1]), "counted": c1 - c0}

    es = measure(lambda: [trainer.step(t) for t in range(steps)])
    grad = measure(lambda: comm.all_reduce(shard, "sum", "dp"))
    torch.save({"es": es, "grad": grad, "params_local": trainer.perturber.numel}, f"{out}.{rank}")


def _summary(parts: list[dict], key: str, steps: int = 1) -> dict:
    counted = [p[key]["counted"] for p in parts]
    by_op: dict = {}
    for c in counted:
        for op, (calls, nbytes) in c.by_op.items():
            cur = by_op.setdefault(op, {"calls": 0, "bytes": 0})
            cur["calls"] += calls
            cur["bytes"] += nbytes
    sent = sum(c.sent for c in counted)
    kernel_bytes, kernel_packets = parts[0][key]["kernel"]  # one interface: every rank reads the same counters
    return {"counted_sent_bytes": sent / steps, "counted_by_op_all_ranks": by_op,
            "kernel_lo_tx_bytes": kernel_bytes / steps, "kernel_lo_tx_packets": kernel_packets / steps,
            "kernel_over_counted": kernel_bytes / sent if sent else None}


def run(layouts, steps: int) -> dict:
    from esopt_mp.parallel.local_world import run_world

    result = {"lo_isolated": os.environ.get("ESOPT_BENCH_NETNS") == "1", "steps": steps, "layouts": {},
              "note": "kernel = loopback tx bytes (payload + TCP/IP headers + ACKs, every collective of every rank); "
                      "at tp > 1 it includes the sharded model's own activation collectives (transformers' TP "
                      "forward passes), which esopt_mp's Collectives do not carry and so do not count"}
    with tempfile.TemporaryDirectory() as tmp:
        for dp, tp in layouts:
            out = os.path.join(tmp, f"out{dp}x{tp}")
            run_world(dp * tp, _worker, dp, tp, steps, os.path.join(tmp, f"run{dp}x{tp}"), out, timeout=900)
            parts = [torch.load(f"{out}.{r}", weights_only=False) for r in range(dp * tp)]
            es, grad = _summary(parts, "es", steps), _summary(parts, "grad")
            tp_bytes = es["counted_by_op_all_ranks"].get("broadcast", {}).get("bytes", 0)  # only the TP channel
            result["layouts"][f"dp{dp}_tp{tp}"] = {
                "params_local": parts[0]["params_local"], "es_per_step": es, "grad_allreduce_fp32": grad,
                "tp_channel_messages_counted_bytes_per_step": tp_bytes,
                "grad_over_es_kernel_bytes": grad["kernel_lo_tx_bytes"] / es["kernel_lo_tx_bytes"],
                "uncounted_kernel_bytes_per_step": es["kernel_lo_tx_bytes"] - es["counted_sent_bytes"],
            }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--layouts", default="2x2,4x1", help="comma-separated DPxTP")
    ap.add_argument("--no-netns", action="store_true", help="measure on the shared loopback")
    args = ap.parse_args()
    if not args.no_netns:
        reexec_in_netns()
    layouts = [tuple(int(x) for x in s.split("x")) for s in args.layouts.split(",")]
    print_record("comm", run(layouts, args.steps))


if __name__ == "__main__":
    main()
