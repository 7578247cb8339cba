"""Reading and validating the run config needs no torch: ``import esopt_mp.config`` in a fresh interpreter."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_importing_the_config_loads_no_torch():
    code = ("import sys; before = set(sys.modules); import esopt_mp.config; import json; "
            "print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in "
            "('torch', 'numpy', 'transformers', 'triton'))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_building_and_validating_the_default_config_runs_without_torch():
    """``build_config({})`` validates every section (objective names included) with torch unimportable."""
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch':\n"
            "            raise ImportError('torch blocked')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from esopt_mp.config import build_config\n"
            "cfg = build_config({}, 1)\n"
            "print(cfg.objective.name, cfg.env.name, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == "False"
