"""tools/setup_browser.py's exit status: 3 only where Chromium or the pip packages cannot be installed (CI skips its
browser stage then), any other failure a real error; a failed step's one-line error ends with that step's output."""
import importlib.util
import os

import pytest

from esopt_mp.envs.web import stack

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_main():
    spec = importlib.util.spec_from_file_location("setup_browser", os.path.join(HERE, "tools", "setup_browser.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _fake_venv(tmp_path, script: str) -> str:
    """A --venv whose bin/python is ``script`` (a shell script standing in for the interpreter)."""
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n" + script)
    py.chmod(0o755)
    return str(tmp_path / "venv")


def _run(monkeypatch, capsys, *argv) -> tuple[int, str]:
    monkeypatch.setattr("sys.argv", ["setup_browser.py", *argv])
    with pytest.raises(SystemExit) as e:
        _setup_main()()
    return e.value.code, capsys.readouterr().err


def test_no_chromium_and_no_apt_is_cannot_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(stack, "DEBIAN_CHROMIUM", (str(tmp_path / "none"),) * 2)
    monkeypatch.setattr(stack.shutil, "which", lambda name: None)
    monkeypatch.delenv("ESOPT_CHROMIUM", raising=False)
    code, err = _run(monkeypatch, capsys, "--no-apt", "--root", str(tmp_path))
    assert code == 3 and "no Chromium found" in err


def test_a_failed_pip_install_is_cannot_install_with_pips_reason(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ESOPT_CHROMIUM", "/bin/sh")  # any executable: apt is not needed
    err = "ERROR: No matching distribution found for browsergym-core==0.14.3"
    venv = _fake_venv(tmp_path, f'case "$2" in *find_spec*) exit 1;; esac\necho "{err}" >&2; exit 1\n')
    code, err = _run(monkeypatch, capsys, "--venv", venv, "--no-apt", "--root", str(tmp_path))
    assert code == 3 and "pip install of the BrowserGym packages failed (exit 1)" in err
    assert "No matching distribution found for browsergym-core" in err


def test_a_failing_last_step_is_a_real_error_showing_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ESOPT_CHROMIUM", "/bin/sh")
    venv = _fake_venv(tmp_path, 'case "$2" in *find_spec*) exit 0;; esac\n'
                                'printf "Traceback\\nPermissionError: [Errno 13] /root/x\\n" >&2; exit 1\n')
    code, err = _run(monkeypatch, capsys, "--venv", venv, "--no-apt", "--root", str(tmp_path))
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("setup_browser: linking Chromium and building the nltk data failed (exit 1)")
    assert "PermissionError: [Errno 13] /root/x" in line
