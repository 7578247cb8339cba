"""One benchmark suite: esopt_mp's headline figures, each a ratio of two things measured side by side in this run.

Sections (each in its own try/except: a failure is reported in its entry and the others still run):

- ``noise``: the counter-based noise generator's throughput and the fused ES update's noise throughput
  (G = 8 and 32 members) over ``torch.randn`` of the same elements and over an fp32 copy of the same
  bytes (tools/bench_noise.py);
- ``es_overhead``: ES's own cost per step (perturb + restore + update, the ``perturb_s`` / ``restore_s`` /
  ``update_s`` of ``ESTrainer.step``) over the step's rollout time (its ``rollout_s`` less perturb and
  restore) on the embedded default (configs/config.yaml: the shipped tiny agent on 4x4 Sudoku) at population
  4 instead of 16, every other setting unchanged;
- ``throughput``: tokens/s of whole ES steps on the embedded default over tokens/s of the same members' rollouts
  at sigma 0 with no perturb, restore, update, gather, ledger or checkpoint, interleaved step by step, with what
  each part costs (tools/bench_throughput.py);
- ``schedule``: ES step time with static and with dynamic member scheduling at dp=2 and dp=4, episodes waiting
  log-normal times on a synthetic slow site (tools/bench_schedule.py);
- ``comm``: bytes an ES step sends vs an fp32 all-reduce of every rank's shard over dp (a data-parallel
  gradient step), counted at the collectives and read from the loopback counters (tools/bench_comm.py);
- ``memory``: the memory profiler's ratios and peaks (tools/memprof.py, run as a subprocess);
- ``rollout``: the engine's generated tokens/s vs a plain ``model.generate`` loop and a batched
  ``model.generate`` on the same games (tools/bench_rollout.py);
- ``endpoint``: generated tokens/s through the OpenAI-compatible endpoint with N concurrent scripted sessions
  (HTTP clients) vs the in-process agent loop on the same conversations (tools/bench_endpoint.py).

Prints one record (esopt_mp.profiling.record: command, machine, library versions, and the sections, ratios and
errors as its figures) as JSON on stdout (``--markdown``: a markdown table of the headline ratios instead) and
writes it to ``--out FILE``. Progress goes to stderr. ``--from-json FILE --markdown`` renders a saved report.

Usage: python tools/bench.py [--quick] [--skip memory,comm] [--out bench.json] [--markdown]
                             [--memprof-shape tiny|0.4b] [--es-steps 2] [--comm-layouts 2x1,2x2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
from tqdm.auto import tqdm

from esopt_mp.profiling.record import bench_record

SECTIONS = ("noise", "es_overhead", "throughput", "schedule", "comm", "memory", "rollout", "endpoint")
# headline ratio -> what it compares (the markdown table's rows, in this order)
HEADLINES = {
    "noise.compiled_over_randn": "counter-based noise (torch.compile) elements/s / torch.randn elements/s",
    "noise.compiled_over_copy": "counter-based noise elements/s / fp32 copy of the same bytes",
    "noise.update_G8_over_randn": "fused update, G=8: noise elements/s / torch.randn elements/s",
    "noise.update_G8_over_copy": "fused update, G=8: noise elements/s / fp32 copy elements/s",
    "noise.update_G32_over_randn": "fused update, G=32: noise elements/s / torch.randn elements/s",
    "noise.update_G32_over_copy": "fused update, G=32: noise elements/s / fp32 copy elements/s",
    "es_overhead.overhead_over_rollout": "ES step's perturb + restore + update time / its rollout time",
    "throughput.es_over_inference": "ES step tokens/s / the same rollouts' tokens/s at sigma 0 with nothing else",
    "throughput.es_over_inference_with_compile": "the same, the noise kernel's one-time compile spread over the run",
    "schedule.static_over_dynamic_dp2": "step time, static / dynamic member scheduling, log-normal episodes, dp=2",
    "schedule.static_over_dynamic_dp4": "step time, static / dynamic member scheduling, log-normal episodes, dp=4",
    "comm.grad_over_es_counted": "fp32 gradient all-reduce bytes / ES step bytes (counted, dp=2)",
    "comm.grad_over_es_kernel": "fp32 gradient all-reduce bytes / ES step bytes (loopback counters, dp=2)",
    "memory.es_over_inference": "ES step (subtract) device peak / inference device peak",
    "memory.grpo_over_es": "agentic GRPO step device peak / ES step device peak",
    "memory.ppo_over_es": "agentic PPO step device peak / ES step device peak",
    "rollout.engine_over_generate_loop": "engine tokens/s / per-episode model.generate loop tokens/s",
    "rollout.engine_over_batched_generate": "engine tokens/s / batched model.generate tokens/s",
    "endpoint.endpoint_over_in_process": "tokens/s through the endpoint (N scripted HTTP sessions) / in-process loop",
}


# ------------------------------------------------------------------ sections
def section_noise(a) -> dict:
    from tools import bench_noise

    n, repeat, un = (1 << 18, 2, 1 << 16) if a.quick else (1 << 24, 5, 1 << 22)
    thr = bench_noise.bench_throughput(n, repeat)
    upd = bench_noise.bench_update(un)
    head = {"compiled_over_randn": thr["compiled_elems_per_s"] / thr["randn_elems_per_s"],
            "compiled_over_copy": thr["compiled_elems_per_s"] / thr["copy_elems_per_s"]}
    for g, r in upd.items():
        head[f"update_{g}_over_randn"] = r["noise_elems_per_s"] / thr["randn_elems_per_s"]
        head[f"update_{g}_over_copy"] = r["noise_elems_per_s"] / thr["copy_elems_per_s"]
    return {"throughput": thr, "update": dict(upd, param_elements=un), "headline": head}


def _embedded_default(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from esopt_mp.config import build_config, open_sections

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        data = OmegaConf.to_container(compose("config", overrides=open_sections(overrides)), resolve=True)
    return build_config(data, 1)


def section_es_overhead(a) -> dict:
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.trainer import ESTrainer

    # population 4 of 16: a quarter of the step's rollouts (~1-2 min on 2 CPUs); the fraction barely moves, as
    # perturb, restore, update and rollouts all scale with the member count (each member plays the same episodes)
    reduced = ["es.population=4", *(["env.episodes_per_step=2", "env.max_turns=3"] if a.quick else [])]
    steps = 1 if a.quick else a.es_steps
    keys = ("rollout_s", "perturb_s", "restore_s", "update_s", "step_s")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _embedded_default([*reduced, f"run.dir={tmp}", "run.trajectories=false"])
        trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
        try:
            recs = [{k: r[k] for k in ("step", *keys)} for r in (trainer.step(t) for t in range(steps))]
            params = trainer.perturber.numel
        finally:
            trainer.close()
    sums = {k: sum(r[k] for r in recs) for k in keys}
    es = sums["perturb_s"] + sums["restore_s"] + sums["update_s"]
    rollout = sums["rollout_s"] - sums["perturb_s"] - sums["restore_s"]  # rollout_s spans the members' perturb/restore
    return {"config": "configs/config.yaml" + (f" with {' '.join(reduced)}" if reduced else " (unchanged)"),
            "population": cfg.es.population, "episodes_per_step": cfg.env.episodes_per_step,
            "max_turns": cfg.env.max_turns, "restore": cfg.es.restore, "noise_backend": cfg.es.noise_backend,
            "params": params, "measured_steps": steps, "steps": recs,
            "per_step_s": {k: v / steps for k, v in sums.items()}, "es_s_per_step": es / steps,
            "rollout_only_s_per_step": rollout / steps,
            "headline": {"overhead_over_rollout": es / rollout, "overhead_over_step": es / sums["step_s"]}}


def section_throughput(a) -> dict:
    from tools import bench_throughput

    return bench_throughput.measure(1 if a.quick else a.throughput_steps, ["es.population=4"] if a.quick else [])


def section_schedule(a) -> dict:
    from tools import bench_schedule

    if a.quick:
        return bench_schedule.run([2], 1, 4, 0.05, 1.5, 1)
    return bench_schedule.run([2, 4], 3, 16, 0.5, 1.5, 1)


def section_comm(a) -> dict:
    from tools import bench_comm

    spec = "2x1" if a.quick else a.comm_layouts
    res = bench_comm.run([tuple(int(x) for x in s.split("x")) for s in spec.split(",")], 1)
    head = {}
    for name, lay in res["layouts"].items():
        es, grad = lay["es_per_step"], lay["grad_allreduce_fp32"]
        lay["grad_over_es_counted_bytes"] = grad["counted_sent_bytes"] / es["counted_sent_bytes"]
        if name == "dp2_tp1":
            head = {"grad_over_es_counted": lay["grad_over_es_counted_bytes"],
                    "grad_over_es_kernel": lay["grad_over_es_kernel_bytes"]}
    if not head:
        res["note_headline"] = "the headline ratios are taken at dp2_tp1, which --comm-layouts left out"
    return dict(res, headline=head)


def section_memory(a) -> dict:
    """memprof's ratios: from a run of its own here, or (``--memprof-json``) a report it wrote earlier."""
    script = os.path.join(ROOT, "tools", "memprof.py")
    if getattr(a, "memprof_json", None):
        with open(a.memprof_json) as f:
            rep = json.load(f)
        source = f"report {a.memprof_json} (measured side by side in that memprof run)"
    else:
        if not os.path.isfile(script):
            return {"error": "tools/memprof.py not found"}
        with tempfile.TemporaryDirectory() as tmp:
            out = a.memprof_out or tmp
            cmd = [sys.executable, script, "--shape", a.memprof_shape, "--out", out]
            env = {k: v for k, v in os.environ.items() if k != "ESOPT_PROG"}  # the child is memprof, not esopt bench
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.memprof_timeout, env=env)
            try:  # a failed profile still leaves the others' report (its "errors" say which)
                rep = _memprof_report(proc.stdout, out)
            except RuntimeError:
                raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        source = f"python tools/memprof.py --shape {a.memprof_shape}"
    profiles = rep["profiles"]
    return {"command": source, "model": rep.get("model"), "nvml": rep.get("nvml"), "method": rep.get("method"),
            "errors": rep.get("errors") or {},
            "device_peak_bytes": {k: p["device_peak_bytes"] for k, p in profiles.items()},
            "host_peak_bytes": {k: p.get("host_peak_bytes") for k, p in profiles.items()},
            "headline": dict(rep["ratios"])}


def _memprof_report(stdout: str, out_dir: str) -> dict:
    """memprof's JSON: the last stdout line if it is the report, else the report file it wrote under --out."""
    lines = stdout.strip().splitlines()
    if lines:
        try:
            rep = json.loads(lines[-1])
            if isinstance(rep, dict) and "profiles" in rep:
                return rep
        except json.JSONDecodeError:
            pass
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                rep = json.load(f)
            if isinstance(rep, dict) and "profiles" in rep:
                return rep
    raise RuntimeError(f"tools/memprof.py printed no JSON report and wrote none under {out_dir}")


def section_rollout(a) -> dict:
    from tools import bench_rollout

    episodes, turns, repeats = (4, 2, 1) if a.quick else (16, 6, 3)
    res = bench_rollout.run(episodes, turns, 10, repeats)
    res["headline"] = {"engine_over_generate_loop": res["speedup_engine_over_generate_loop"],
                       "engine_over_batched_generate": res["speedup_engine_over_batched_generate"]}
    if not all(res["same_games"].values()):
        res["warning"] = "the variants did not play the same games; their tokens/s are not comparable"
    return res


def section_endpoint(a) -> dict:
    from tools import bench_endpoint

    sessions, repeats = (4, 1) if a.quick else (8, 3)
    res = bench_endpoint.run(sessions, 3, 16, repeats)
    res["headline"] = {"endpoint_over_in_process": res["endpoint_over_in_process"]}
    if not res["same_conversations"]:
        res["warning"] = "the endpoint and the loop did not play the same conversations; their tokens/s differ in work"
    return res


# ------------------------------------------------------------------ report
def run(a) -> dict:
    skip = {s for s in a.skip.split(",") if s}
    unknown = skip - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--skip: unknown section(s) {sorted(unknown)}; sections are {list(SECTIONS)}")
    report = {"quick": a.quick, "sections": {}, "ratios": {}, "errors": {}}
    t_all = time.perf_counter()
    bar = tqdm(SECTIONS, desc="bench", file=sys.stderr, dynamic_ncols=True)
    for name in bar:
        if name in skip:
            report["sections"][name] = {"skipped": True}
            continue
        bar.set_description(f"bench: {name}")
        t = time.perf_counter()
        try:
            res = globals()[f"section_{name}"](a)
        except Exception as e:  # noqa: BLE001 -- one section's failure is its report, the rest still run
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
        res["seconds"] = time.perf_counter() - t
        report["sections"][name] = res
        if "error" in res:
            report["errors"][name] = res["error"]
        for k, v in res.get("headline", {}).items():
            report["ratios"][f"{name}.{k}"] = v
        tqdm.write(f"bench: {name} {'FAILED: ' + res['error'] if 'error' in res else 'done'} "
                   f"in {res['seconds']:.1f} s", file=sys.stderr)
    report["seconds_total"] = time.perf_counter() - t_all
    return report


def markdown(record: dict) -> str:
    """The headline ratios of a suite's record as a markdown table, under the command and machine it ran on."""
    m, report = record["machine"], record.get("figures", record)  # a report saved before the record: flat
    rows = ["| figure | ratio | compares |", "|---|---:|---|"]
    for key, what in HEADLINES.items():
        sec = report["sections"].get(key.split(".")[0], {})
        if key in report["ratios"]:
            v = report["ratios"][key]
            cell = f"{v:.3g}" if isinstance(v, (int, float)) and math.isfinite(v) else str(v)
        elif sec.get("skipped"):
            continue
        elif "error" in sec:
            cell = "error"
        else:
            continue
        if key.startswith("memory.") and sec.get("model"):  # which shape the memory ratios were measured on
            mdl = sec["model"]
            what = f"{what} ({mdl.get('shape')}, {mdl.get('params', 0) / 1e9:.2f} B params, tp={mdl.get('tp')})"
        rows.append(f"| `{key}` | {cell} | {what} |")
    torch_version = record.get("versions", m)["torch"]  # a report saved before the record kept it in "machine"
    head = (f"`{record['command']}` on {m['device']}, {m['cpus_usable']} CPUs, torch {torch_version} "
            f"({report['seconds_total']:.0f} s)")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0],
                                 epilog="One benchmark alone: esopt bench NAME [its options]; esopt bench list names "
                                        "them.")
    ap.add_argument("--quick", action="store_true", help="small sizes in every section (smoke test, ~1 min)")
    ap.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table of the headline ratios, not JSON")
    ap.add_argument("--from-json", help="render --markdown from a saved report instead of running")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS") or os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    ap.add_argument("--es-steps", type=int, default=2, help="ES steps measured on the embedded default")
    ap.add_argument("--throughput-steps", type=int, default=6, help="ES steps of the throughput section")
    ap.add_argument("--comm-layouts", default="2x1,2x2", help="DPxTP worlds for the comm section")
    ap.add_argument("--memprof-shape", default="tiny", help="tools/memprof.py --shape (e.g. tiny, 0.4b)")
    ap.add_argument("--memprof-out", help="keep memprof's JSON and plots in this directory")
    ap.add_argument("--memprof-json", help="take the memory ratios from this memprof report instead of running it "
                                           "(a 0.4b profile takes ~30 min on 2 CPU cores)")
    ap.add_argument("--memprof-timeout", type=float, default=3600.0)
    ap.add_argument("--no-netns", action="store_true", help="do not isolate the loopback counters in a netns")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            print(markdown(json.load(f)), end="")
        return
    if a.es_steps < 1:
        raise SystemExit("--es-steps must be >= 1")
    if not a.no_netns and "comm" not in a.skip.split(","):
        from tools.bench_comm import reexec_in_netns

        reexec_in_netns()  # exits with the isolated run's status, or returns when not possible / already inside
    torch.set_num_threads(max(1, a.threads))
    report = bench_record("suite", run(a))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    print(markdown(report) if a.markdown else json.dumps(report), end="" if a.markdown else "\n")


if __name__ == "__main__":
    main()
