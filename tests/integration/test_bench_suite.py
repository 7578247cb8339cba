"""tools/bench.py: one JSON record of finite positive ratios; a failing section is reported and the rest still run."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    skip = "comm,memory,rollout,endpoint,schedule"
    proc = subprocess.run([sys.executable, "tools/bench.py", "--quick", "--skip", skip, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, BENCH_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bench: noise done" in proc.stderr and "bench: es_overhead done" in proc.stderr  # a line per section
    report = json.loads(proc.stdout)  # stdout is the one JSON object
    with open(out) as f:
        assert json.load(f) == report
    return report, out


def test_report_schema_and_ratios(quick):
    rec, _ = quick
    assert set(rec) == {"benchmark", "command", "machine", "versions", "figures"} and rec["benchmark"] == "suite"
    assert {"cpu_count", "cpus_usable", "device", "torch_threads", "git_commit"} <= set(rec["machine"])
    assert rec["versions"]["torch"] and rec["versions"]["transformers"]
    assert rec["command"].startswith("python tools/bench.py --quick")
    r = rec["figures"]
    assert r["quick"] is True and r["errors"] == {}
    assert r["sections"]["comm"] == r["sections"]["memory"] == r["sections"]["rollout"] == {"skipped": True}
    assert r["sections"]["endpoint"] == r["sections"]["schedule"] == {"skipped": True}
    for name in ("noise", "es_overhead", "throughput"):
        assert r["sections"][name]["seconds"] > 0
    expected = {"noise.compiled_over_randn", "noise.compiled_over_copy", "noise.update_G8_over_randn",
                "noise.update_G8_over_copy", "noise.update_G32_over_randn", "noise.update_G32_over_copy",
                "es_overhead.overhead_over_rollout", "es_overhead.overhead_over_step",
                "throughput.es_over_inference", "throughput.es_over_inference_with_compile"}
    assert set(r["ratios"]) == expected
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in r["ratios"].values()), r["ratios"]
    es = r["sections"]["es_overhead"]
    assert es["measured_steps"] == 1 and es["population"] == 4 and "es.population=4" in es["config"]
    step = es["steps"][0]
    parts = step["perturb_s"] + step["restore_s"] + step["update_s"]
    assert es["headline"]["overhead_over_rollout"] == pytest.approx(
        parts / (step["rollout_s"] - step["perturb_s"] - step["restore_s"]))
    assert es["headline"]["overhead_over_step"] < 1  # ES's parts are inside the step
    th = r["sections"]["throughput"]
    assert th["measured_steps"] == 1 and th["es"]["tokens"] > 0 and th["inference"]["tokens"] > 0
    assert th["headline"]["es_over_inference"] == pytest.approx(
        th["es"]["tokens_per_s"] / th["inference"]["tokens_per_s"])


def test_markdown_from_saved_report(quick):
    rec, out = quick
    r = rec["figures"]
    proc = subprocess.run([sys.executable, "tools/bench.py", "--from-json", str(out), "--markdown"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [k for k in r["ratios"] if k != "es_overhead.overhead_over_step"]
    assert rec["command"] in proc.stdout


def test_a_failing_section_is_reported_and_the_others_run(monkeypatch, tmp_path):
    from tools import bench

    def broken(a):
        raise ValueError("broken on purpose")

    monkeypatch.setattr(bench, "section_noise", broken)
    monkeypatch.setattr(bench, "ROOT", str(tmp_path))  # no tools/memprof.py here
    monkeypatch.setattr(bench, "section_es_overhead", lambda a: {"headline": {"overhead_over_rollout": 0.5}})
    monkeypatch.setattr(sys, "argv", ["tools/bench.py", "--skip", "comm,rollout,endpoint,throughput,schedule"])
    a = type("A", (), {"skip": "comm,rollout,endpoint,throughput,schedule", "quick": True})()
    r = bench.run(a)
    assert r["errors"]["noise"] == "ValueError: broken on purpose" and "traceback" in r["sections"]["noise"]
    assert r["errors"]["memory"] == "tools/memprof.py not found"
    assert r["ratios"] == {"es_overhead.overhead_over_rollout": 0.5}
    assert "| `memory.es_over_inference` | error |" in bench.markdown(bench.bench_record("suite", r))


def test_memprof_report_is_read_from_stdout_or_its_out_dir(tmp_path):
    from tools.bench import _memprof_report

    rep = {"profiles": {"inference": {"device_peak_bytes": 1}}, "ratios": {"es_over_inference": 1.0}}
    assert _memprof_report("progress\n" + json.dumps(rep) + "\n", str(tmp_path)) == rep
    (tmp_path / "memprof.json").write_text(json.dumps(rep))
    assert _memprof_report("wrote plots\n", str(tmp_path)) == rep
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="no JSON report"):
        _memprof_report("", str(empty))


def test_the_endpoint_section_measures_both_on_the_same_conversations():
    from tools import bench

    r = bench.section_endpoint(type("A", (), {"quick": True})())
    assert r["same_conversations"] is True and r["sessions"] == 4
    assert r["endpoint"]["tokens"] == r["in_process"]["tokens"] > 0  # the same replies, counted on both sides
    ratio = r["headline"]["endpoint_over_in_process"]
    assert math.isfinite(ratio) and ratio > 0
