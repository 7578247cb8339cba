"""Importing GEM (in a fresh interpreter) leaves the root logger alone."""
import pytest

pytest.importorskip("gem")

from esopt_mp.envs.libs import gem as adapter  # noqa: E402


def test_import_leaves_the_root_logger_alone():
    import subprocess
    import sys

    code = ("import logging; from esopt_mp.envs.libs.gem import _gem; _gem(); "
            "print(len(logging.getLogger().handlers), logging.getLogger().level)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", str(30)], out.stderr[-500:]
    assert adapter.GemEnv.returns == "sum"
