"""tools/memprof.py end to end on the tiny shape: stable JSON keys, both figures, host-by-design bytes."""
import json
import os
import platform
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_memprof_tiny(tmp_path):
    out = tmp_path / "mp"
    proc = subprocess.run([sys.executable, "tools/memprof.py", "--shape", "tiny", "--out", str(out),
                           "--profiles", "inference", "es_subtract", "es_snapshot_fp32_host",
                           "--batch", "2", "--turns", "2", "--first-prompt", "8", "--turn-prompt", "4",
                           "--new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r == json.loads((out / "memprof.json").read_text())
    params = r["model"]["params"]
    assert params == 298664 and r["model"]["tp"] == 1 and r["workload"]["context"] == 8 + 2 * 4 + 4
    assert set(r["profiles"]) == {"inference", "es_subtract", "es_snapshot_fp32_host"}
    for p in r["profiles"].values():
        assert p["device_peak_bytes"] > 0 and p["host_peak_bytes"] > p["baseline_bytes"] > 0 and p["method"]
    inf, es, fp32 = (r["profiles"][k] for k in ("inference", "es_subtract", "es_snapshot_fp32_host"))
    assert es["decode_tokens"] == 2 * inf["decode_tokens"] == 2 * 2 * 2 * 4  # 2 members x 2 rows x 2 turns x 4 tokens
    assert es["host_by_design_bytes"] == 0
    assert 4 * params <= fp32["host_by_design_bytes"] < 4 * params + 64 * 200  # the fp32 master, 64 B aligned
    assert set(fp32["phases"]) >= {"setup", "perturb", "rollouts", "restore", "update"}
    for p in r["profiles"].values():  # device-equivalent = window peak - baseline - host-by-design, host bytes once
        rk = p["per_rank"][0]
        assert p["device_peak_bytes"] == rk["window"]["host_peak_bytes"] - rk["baseline_bytes"] - rk["host_by_design_bytes"]
        assert p["host_peak_bytes"] == rk["window"]["host_peak_bytes"]
    assert "NVML unavailable" in proc.stderr or r["nvml"]  # the user is told once, by the parent
    assert r["ratios"]["es_over_inference"] == round(es["device_peak_bytes"] / inf["device_peak_bytes"], 4)
    assert set(r["ratios"]) == {"es_over_inference", "grpo_over_es", "ppo_over_es"}
    assert "prediction" in r and ("device-equivalent" in r["method"]) == (r["device"] == "cpu")
    for png in ("memprof_bars.png", "memprof_timeline.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / ".ckpt-tiny").exists()  # the random checkpoint is removed unless --keep-checkpoint
    v = r["versions"]  # what produced the figures
    assert v["python"] == platform.python_version() and v["platform"] and v["torch"] and v["transformers"]
    assert {"triton", "vllm", "cuda", "driver", "gpus"} <= set(v)


# On PYTHONPATH in every process: tearing a process group down aborts, as gloo's destructor can when a peer has
# closed its sockets first.
_TEARDOWN_ABORTS = """
import os
import torch.distributed as dist

dist.destroy_process_group = lambda *a, **k: os.abort()
"""


def test_memprof_two_ranks_keeps_its_profile_where_a_teardown_would_abort(tmp_path):
    """tp=2 under torchrun: each rank's worker writes its result, meets its peer, and ends without tearing its
    gloo group down; the report has both ranks of the profile."""
    from esopt_mp.parallel.local_world import free_port

    site, out = tmp_path / "site", tmp_path / "mp"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_TEARDOWN_ABORTS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(site), ROOT]),
               CUDA_VISIBLE_DEVICES="")  # gloo's path: with a GPU the ranks would take NCCL
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "tools/memprof.py", "--shape", "tiny", "--tp", "2",
                           "--out", str(out), "--profiles", "inference", "--batch", "2", "--turns", "2",
                           "--first-prompt", "8", "--turn-prompt", "4", "--new-tokens", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["model"]["tp"] == 2 and set(r["profiles"]) == {"inference"}
    assert len(r["profiles"]["inference"]["per_rank"]) == 2 and "exited" not in proc.stderr


def test_a_profile_written_before_its_worker_died_is_kept(tmp_path, capsys, monkeypatch):
    """A worker that exits non-zero after writing its result (killed in its teardown): the profile stands, with
    one line saying so; one that wrote nothing still fails."""
    sys.path.insert(0, ROOT)
    from tools import memprof

    real = memprof._spawn

    def dies_after_writing(cmd, env, timeout):
        rc, log = real(cmd, env, timeout)
        return (-6, log) if "--worker" in cmd else (rc, log)

    monkeypatch.setattr(memprof, "_spawn", dies_after_writing)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--shape", "tiny", "--out", str(tmp_path / "mp"), "--profiles", "inference", "--batch", "2", "--turns",
            "1", "--first-prompt", "8", "--turn-prompt", "4", "--new-tokens", "2"]
    assert memprof.main(argv) == 0
    out = capsys.readouterr()
    assert set(json.loads(out.out.strip().splitlines()[-1])["profiles"]) == {"inference"}
    assert "memprof: profile inference on rank 0 exited -6 after writing its result" in out.err
    monkeypatch.setattr(memprof, "_spawn", lambda cmd, env, timeout: (-6, "killed") if "--worker" in cmd else real(
        cmd, env, timeout))
    assert memprof.main(argv) != 0 and "profile inference failed on rank 0 (exit -6)" in capsys.readouterr().err
