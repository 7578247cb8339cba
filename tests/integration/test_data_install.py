"""A non-editable pip install carries every shipped data file (pip and a fresh interpreter)."""
import json
import os
import subprocess
import sys


from tests.unit.test_data import PKG_DATA, ROOT


def test_non_editable_install_contains_the_data(tmp_path):
    """`pip install .` (not editable) carries every data file; the installed copy resolves them from anywhere."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                    "--target", str(target), os.path.abspath(ROOT)], check=True, cwd=tmp_path,
                   env=dict(os.environ, PIP_NO_CACHE_DIR="1"))
    got_root = target / "esopt_mp" / "data"
    want, got = ({os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs
                  if not f.endswith((".py", ".pyc"))} for top in (PKG_DATA, got_root))
    assert len(want) >= 60 and want == got, sorted(want ^ got)
    code = ("import json, esopt_mp.data as d; print(json.dumps([d.data_root(), "
            "sum(1 for _ in open(d.data_path('sudoku/train.jsonl')))]))")
    env = {k: v for k, v in os.environ.items() if k not in ("ESOPT_DATA", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=dict(env, PYTHONPATH=str(target)))
    root, rows = json.loads(out.stdout)
    assert os.path.samefile(root, got_root) and rows == 128
