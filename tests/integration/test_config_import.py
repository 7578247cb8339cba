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
