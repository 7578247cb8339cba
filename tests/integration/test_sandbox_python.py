"""The sandbox runs the trainer's own interpreter with the trainer's import path, at every level available here,
and so does every ``python3`` started inside it (bash, shebang scripts, DocVQA's imgtool).

The trainer here is a subprocess started from a plain venv (no system site-packages) whose packages come only
from the venv's own site-packages (found through its pyvenv.cfg) and from ``PYTHONPATH``, as on an HPC node or
in a fresh venv. CI reruns this file as an unprivileged user (``.ci/nonroot-sandbox``)."""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

import esopt_mp
import numpy
from esopt_mp.envs.sandbox import LEVELS, Sandbox, SandboxUnavailable, probe
from esopt_mp.envs.sandbox import core

# what the sandboxed code reports: its own imports, then a bash `python3 -c` and a `#!/usr/bin/env python3` script
CODE = r'''
import json, os, subprocess, sys
import esopt_venv_marker, esopt_pp_marker, numpy
def report(who):
    return json.dumps({"who": who, "exe": sys.executable, "path": sys.path, "venv": esopt_venv_marker.__file__,
                       "pp": esopt_pp_marker.__file__, "numpy": numpy.__file__})
with open("tool.py", "w") as f:
    f.write("#!/usr/bin/env python3\nimport json, sys, esopt_venv_marker, esopt_pp_marker, numpy\n"
            "print(json.dumps({'who': 'shebang', 'exe': sys.executable, 'path': sys.path, "
            "'venv': esopt_venv_marker.__file__, 'pp': esopt_pp_marker.__file__, 'numpy': numpy.__file__}))\n")
os.chmod("tool.py", 0o755)
print(report("child"), flush=True)
with open("report.py", "w") as f:
    f.write("import json, sys, esopt_venv_marker, esopt_pp_marker, numpy\n"
            "print(json.dumps({'who': 'bash', 'exe': sys.executable, 'path': sys.path, "
            "'venv': esopt_venv_marker.__file__, 'pp': esopt_pp_marker.__file__, 'numpy': numpy.__file__}))\n")
subprocess.run(["bash", "-c", "python3 report.py && ./tool.py"], check=True)
'''

TRAINER = r'''
import json, shutil, sys
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits
level, code = sys.argv[1], sys.argv[2]
sb = Sandbox(SandboxLimits(wall_s=30, cpu_s=20, memory_mb=1024, nproc=16), level=level)
r = sb.run_python(code)
out = {"stdout": r.stdout, "error": r.error, "stderr": r.stderr[-800:], "docvqa": None}
if shutil.which("tesseract"):  # DocVQA's bash tool: imgtool and python3 run the trainer's interpreter too
    import tempfile
    from esopt_mp.envs import make
    from esopt_mp.envs.docvqa_gen import generate
    env = make("docvqa", sandbox=sb)
    env.reset(generate(1, tempfile.mkdtemp(), seed=3)[0])
    t = env.run_bash("imgtool info /workspace/document.png && python3 -c 'import esopt_venv_marker, esopt_pp_marker, "
                     "sys; print(sys.executable)'")
    out["docvqa"] = {"stdout": t.stdout, "error": t.error, "stderr": t.stderr[-800:]}
    env.close()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def trainer_venv():
    """A plain venv with a marker package in its site-packages, a marker directory for PYTHONPATH, and the
    PYTHONPATH that gives it numpy and esopt_mp (neither is installed in the venv)."""
    root = tempfile.mkdtemp(prefix="esopt_venv_test_")
    os.chmod(root, 0o755)  # the per-call uid (root runs) reads it
    try:
        venv = os.path.join(root, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        exe = os.path.join(venv, "bin", "python")
        site = subprocess.run([exe, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
        pp = os.path.join(root, "pp")
        for base, name in ((site, "esopt_venv_marker"), (pp, "esopt_pp_marker")):
            os.makedirs(os.path.join(base, name))
            with open(os.path.join(base, name, "__init__.py"), "w") as f:
                f.write("")
        numpy_site = os.path.dirname(os.path.dirname(numpy.__file__))
        project = os.path.dirname(os.path.dirname(esopt_mp.__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([pp, numpy_site, project]))
        subprocess.run(["chmod", "-R", "o+rX", root], check=True)
        yield {"exe": exe, "site": os.path.realpath(site), "pp": os.path.realpath(pp), "env": env,
               "pythonpath": [os.path.realpath(p) for p in (pp, numpy_site, project)],
               "numpy": os.path.realpath(numpy.__file__)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("level", LEVELS)
def test_code_and_its_tools_run_the_trainers_interpreter_and_packages(trainer_venv, level):
    why = probe(level)
    if why:
        pytest.skip(f"level {level} unavailable for uid {os.getuid()}: {why}")
    v = trainer_venv
    p = subprocess.run([v["exe"], "-c", TRAINER, level, CODE], env=v["env"], cwd="/", capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["error"] is None, (out["error"], out["stderr"])
    reports = {r["who"]: r for r in map(json.loads, out["stdout"].splitlines())}
    assert sorted(reports) == ["bash", "child", "shebang"], out["stdout"]
    venv_bin = os.path.join(os.path.realpath(os.path.dirname(v["exe"])), "python")
    for who, r in reports.items():
        assert r["exe"] == venv_bin, (who, r["exe"])  # the venv's python, not the interpreter it links to
        assert r["venv"].startswith(v["site"] + "/") and r["pp"].startswith(v["pp"] + "/"), (who, r)
        assert os.path.realpath(r["numpy"]) == v["numpy"], (who, r["numpy"])
        assert v["site"] in r["path"], (who, r["path"])
        # the trainer's PYTHONPATH in its order; the bootstrap adds neither the cwd nor anything before it
        path = [q for q in r["path"] if q in v["pythonpath"]]
        assert path == v["pythonpath"], (who, r["path"])
    child = reports["child"]["path"]
    assert child[:len(v["pythonpath"])] == v["pythonpath"] and "" not in child
    if out["docvqa"] is not None:
        d = out["docvqa"]
        assert d["error"] is None, (d["error"], d["stderr"])
        size, exe = d["stdout"].split("\n")[:2]
        assert size.split()[0].count("x") == 1 and exe == venv_bin, d["stdout"]


def test_probe_names_an_import_the_sandbox_cannot_make(monkeypatch):
    """Without numpy's directory on the sandbox's import path, the reason names that, not bubblewrap."""
    levels = [lv for lv in LEVELS if probe(lv) is None]
    if not levels:
        pytest.skip(f"no sandbox level works here for uid {os.getuid()}")
    py = core.interpreter()
    numpy_dir = os.path.realpath(os.path.dirname(os.path.dirname(numpy.__file__)))
    hidden = dataclasses.replace(py, path=tuple(p for p in py.path if os.path.realpath(p) != numpy_dir))
    monkeypatch.setattr(core, "interpreter", lambda: hidden)
    why = probe(levels[0])
    assert why and why.startswith(f"the sandboxed interpreter {py.executable} cannot import numpy from {numpy_dir}:")
    assert "No module named 'numpy'" in why
    with pytest.raises(SandboxUnavailable, match="cannot import numpy") as e:
        Sandbox(level=levels[0])
    assert "bubblewrap" not in str(e.value)


_LIB = "int esopt_rpath_answer(void) { return 42; }\n"
_MOD = r'''#include <Python.h>
int esopt_rpath_answer(void);
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(esopt_rpath_answer()); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {0}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "esopt_rpath_mod", 0, -1, methods};
PyMODINIT_FUNC PyInit_esopt_rpath_mod(void) { return PyModule_Create(&def); }
'''


@pytest.fixture
def open_tmp():
    """A scratch folder the per-call uid of root runs can reach: pytest's own tmp_path sits under a 0700
    /tmp/pytest-of-<user>."""
    root = tempfile.mkdtemp(prefix="esopt_rpath_test_")
    os.chmod(root, 0o755)
    try:
        yield pathlib.Path(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("level", LEVELS)
def test_an_extension_finding_its_library_through_rpath_imports_in_the_sandbox(open_tmp, level):
    """HPC module trees (Spack) link extensions to libraries in their own prefix through RPATH, outside every
    import path: the sandbox shows the folders of the libraries the trainer has loaded."""
    import sysconfig

    why = probe(level)
    if why:
        pytest.skip(f"level {level} unavailable for uid {os.getuid()}: {why}")
    include = sysconfig.get_paths()["include"]
    if not shutil.which("gcc") or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("needs gcc and Python's headers to build the extension")
    lib, pkg = open_tmp / "prefix" / "lib", open_tmp / "pkg"
    lib.mkdir(parents=True)
    pkg.mkdir()
    (open_tmp / "lib.c").write_text(_LIB)
    (open_tmp / "mod.c").write_text(_MOD)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib / "libesoptrp.so"), str(open_tmp / "lib.c")], check=True)
    ext = pkg / ("esopt_rpath_mod" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{include}", "-o", str(ext), str(open_tmp / "mod.c"), f"-L{lib}",
                    "-lesoptrp", f"-Wl,-rpath,{lib}"], check=True)
    subprocess.run(["chmod", "-R", "o+rX", str(open_tmp)], check=True)  # the per-call uid of root runs
    code = ("import esopt_rpath_mod\nfrom esopt_mp.envs.sandbox import Sandbox\n"
            f"print(esopt_rpath_mod.answer(), Sandbox(level={level!r}).run_python("
            "'import esopt_rpath_mod; print(esopt_rpath_mod.answer())').stdout.strip())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg), os.path.dirname(os.path.dirname(esopt_mp.__file__))]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["42", "42"], (p.stdout, p.stderr[-1500:])
