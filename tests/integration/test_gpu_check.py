"""tools/gpu_check.sh without vLLM, on a CPU: the hf measurements come out as numbers, vLLM is reported as not
available, a failing part is reported with its error, the JSON line is always printed; and the wheel installer
for a node without network (tools/gpu_wheels_install.py) installs only what is missing, from a folder."""
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = "--shape tiny --batch 2 --turns 1 --new-tokens 4 --members 2"


def _no_vllm(tmp_path) -> str:
    """A folder whose ``vllm`` package fails to import, as on a node without vLLM (whether or not it is here)."""
    d = tmp_path / "novllm"
    (d / "vllm").mkdir(parents=True)
    (d / "vllm" / "__init__.py").write_text("raise ImportError('no vllm on this node (test stand-in)')\n")
    return str(d)


def _gpu_check(tmp_path, *argv, **env):
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    path = os.pathsep.join(p for p in (_no_vllm(tmp_path), os.environ.get("PYTHONPATH")) if p)
    full = dict(os.environ, PYTHONPATH=path, PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                ESOPT_GPU_CHECK_DIR=str(tmp_path / "work"))
    full.update({"ESOPT_GPU_CHECK_ARGS": TINY, "ESOPT_GPU_CHECK_MEMBERS_ARGS": "--G 2 --episodes 1 --tokens 2", **env})
    if "ESOPT_WHEELS" not in env:
        full.pop("ESOPT_WHEELS", None)  # no wheels unless the test gives them
    proc = subprocess.run(["bash", "tools/gpu_check.sh", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=110, env=full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def test_gpu_check_measures_hf_without_vllm(tmp_path):
    r = _gpu_check(tmp_path)
    hf = r["eager"]["hf"]
    assert "exit" not in r["eager"], r["eager"]
    assert _number(hf["tokens_per_s"]) and hf["tokens_per_s"] > 0
    assert hf["tokens"] == 2 * 1 * 4 and hf["es_tokens"] == 2 * 2 * hf["tokens"]  # EOS ignored: full turns
    assert _number(hf["es_overhead_fraction"]) and 0 < hf["es_overhead_fraction"] < 1
    assert _number(hf["es_step_s"]) and hf["es_step_s"] > 0
    mem = hf["memory"]  # on a CPU: host figures only (NVML and torch's allocator are the GPU's)
    assert mem["nvml"] is False and _number(mem["es_over_inference"]["host_peak_bytes"])
    assert mem["inference"]["host_peak_bytes"] > 0 and mem["es"]["host_peak_bytes"] > 0
    vllm = r["eager"]["vllm"]
    assert vllm["available"] is False and "vllm does not import" in vllm["reason"]
    assert r["graphs"]["skipped"] and "vLLM not available" in r["graphs"]["reason"]
    members = r["members"]["table"]  # the random checkpoint's members in one batch, measured on the CPU
    assert "exit" not in r["members"] and set(members) == {"2"}, r["members"]
    assert all(_number(m["tokens_per_s"]) and m["tokens_per_s"] > 0 for g in members.values() for m in g.values())
    for part in ("noise_check", "noise"):  # no CUDA here: the Triton kernels' parts say why they skipped
        assert r[part]["skipped"] and "CUDA" in r[part]["reason"], r[part]
    assert r["pinned"]["tests"] == 2 and r["pinned"]["skipped"] == 2 and r["pinned"]["ok"], r["pinned"]
    env = r["env"]
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["transformers"] and env["platform"] and env["cuda_available"] is False
    assert r["setup"]["wheels"] is None and "target" in r["setup"]
    assert r["seconds"] < r["budget_s"] == 460


def test_a_failing_part_is_reported_and_the_line_still_printed(tmp_path):
    r = _gpu_check(tmp_path, "--wheels", str(tmp_path / "no-such-folder"), ESOPT_GPU_CHECK_ARGS="--engines nosuch")
    assert r["setup"]["skipped"] and "no wheel folder" in r["setup"]["reason"]
    assert r["eager"]["exit"] == 2 and "--engines" in r["eager"]["error_tail"]  # argparse's own message
    assert r["graphs"]["skipped"] and "the eager part gave no result" in r["graphs"]["reason"]
    assert r["env"]["python"] and r["pinned"]["ok"]  # the other parts ran all the same


def _wheel(folder, name: str, version: str) -> str:
    """A minimal pure-python wheel holding one module ``name`` with VERSION = ``version``."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: esopt-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in [*files, f"{dist}/RECORD"])
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def test_wheels_install_only_what_is_missing(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(str(wheels), "esopt_probe_pkg", "1.0")

    def install(*modules):
        p = subprocess.run([sys.executable, "tools/gpu_wheels_install.py", str(wheels), str(target), *modules],
                           cwd=ROOT, capture_output=True, text=True, timeout=100)
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])

    rc, r = install("esopt_probe_pkg=esopt-probe-pkg>=1", "json=json")  # json: here already, left alone
    assert rc == 0 and r["missing"] == {"esopt-probe-pkg": "not installed"}, r
    assert r["installed"] == ["esopt_probe_pkg-1.0-py3-none-any.whl"] and r["still_missing"] == {}
    out = subprocess.run([sys.executable, "-c", "import esopt_probe_pkg; print(esopt_probe_pkg.VERSION)"],
                         env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1.0", out.stderr
    rc, r = install("esopt_probe_pkg=esopt-probe-pkg>=1")  # installed by the run before: nothing to do
    assert rc == 0 and r["missing"] == {} and r["installed"] == []
    rc, r = install("esopt_probe_pkg=esopt-probe-pkg>=2")  # there, in a version that does not do; no better wheel
    assert rc == 1 and r["missing"] == {"esopt-probe-pkg": "esopt-probe-pkg 1.0, needs >=2"}
    assert r["still_missing"] == {"esopt-probe-pkg": "esopt-probe-pkg 1.0, needs >=2"}
