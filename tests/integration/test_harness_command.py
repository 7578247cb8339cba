"""A harness command as the trainer runs it (``command_job``): its output read as bytes whatever it holds open or
prints, every process it started ended with it (in its session or not, the trainer PID 1 or killed), the
environment it is given, and its stderr kept on one escaped line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from esopt_mp.agent.harness_run import HarnessPool, command_job, harness_env
from esopt_mp.config import ConfigError, build_config

WALL_S = 120.0  # far past what any of these takes on a loaded machine: only a harness that hangs reaches it


def _script(tmp_path, name: str, body: str) -> list[str]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _play(argv, task=None, **kw):
    """One episode under the pool's wall clock, as the trainer plays it."""
    pool = HarnessPool([command_job(argv, "http://127.0.0.1:9/v1", "member-0-0", "", task or {}, -1.0, **kw)],
                       concurrency=1, timeout_s=WALL_S, failure_return=-1.0).start()
    assert pool.wait(WALL_S + 30)
    return pool.outcomes[0]


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _gone(pids, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_state(p) not in (None, "Z") for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


HELPER_IN_ITS_OWN_SESSION = """
    import json, subprocess, sys
    task = json.load(sys.stdin)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    open(task["pids"], "w").write(str(helper.pid))
    print("0.5", flush=True)  # the helper holds stdout open: no end of file while it runs
"""
INVALID_BYTE_ON_STDOUT = """
    import sys
    sys.stdin.read()
    sys.stdout.buffer.write(b"caf\\xe9\\n0.5\\n")
"""
INVALID_BYTE_THEN_A_FLOOD_ON_STDERR = """
    import sys, time
    sys.stdin.read()
    sys.stderr.buffer.write(b"\\xff\\n")
    sys.stderr.flush()
    time.sleep(0.2)  # read on its own: a reader that dies on it leaves the pipe full under the flood below
    for i in range(4096):
        sys.stderr.write(f"log line {i:6d} of the harness\\n")
    sys.stderr.flush()
    print("0.5")
"""


@pytest.mark.parametrize("body", [HELPER_IN_ITS_OWN_SESSION, INVALID_BYTE_ON_STDOUT,
                                  INVALID_BYTE_THEN_A_FLOOD_ON_STDERR], ids=["setsid_helper", "stdout", "stderr"])
def test_a_printed_return_is_kept_whatever_the_command_holds_open_or_prints(tmp_path, body):
    pids = tmp_path / "pids"
    out = _play(_script(tmp_path, "harness", body), {"pids": str(pids)})
    assert (out.ret, out.failure, out.error) == (0.5, None, None)
    if pids.exists():  # the helper in its own session was ended with the episode
        assert _state(int(pids.read_text())) is None


def test_every_descendant_is_ended_and_reaped_when_the_command_exits(tmp_path):
    """A daemon (double fork, its parent gone, in a session of its own) and a plain background child: both ended
    and reaped."""
    pids = tmp_path / "pids"
    argv = _script(tmp_path, "harness", """
        import json, os, subprocess, sys, time
        task = json.load(sys.stdin)
        if os.fork() == 0:  # the daemon's way out of every group and parent
            os.setsid()
            if os.fork() == 0:
                with open(task["pids"], "a") as f:
                    f.write(f"{os.getpid()}\\n")
                time.sleep(300)
            os._exit(0)
        child = subprocess.Popen(["sleep", "300"])
        with open(task["pids"], "a") as f:
            f.write(f"{child.pid}\\n")
        while len(open(task["pids"]).read().split()) < 2:
            time.sleep(0.01)
        print(1.5)
    """)
    out = _play(argv, {"pids": str(pids)})
    assert out.ret == 1.5 and out.failure is None
    left = [int(p) for p in pids.read_text().split()]
    assert len(left) == 2 and all(_state(p) is None for p in left)  # gone, and reaped (no zombie)


PID1 = """
    import os, sys
    from esopt_mp.agent.harness_run import command_job, Slot
    assert os.getpid() == 1
    def zombies():
        found = 0
        for p in os.listdir("/proc"):
            try:
                found += p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                pass
        return found
    for i in range(5):
        out = command_job(sys.argv[1:], "http://127.0.0.1:9/v1", "m", "", {}, 0.0)(Slot())
        assert out.ret == 0.5, out
    print(zombies())
"""


def test_a_trainer_that_is_pid_1_collects_no_zombies(tmp_path):
    """In a container without an init the trainer is PID 1: every orphan is its child. Five episodes that each
    leave a background child behind leave no zombie."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True) if unshare \
        else None
    if probe is None or probe.returncode != 0:
        pytest.skip("unshare --pid --mount-proc is not permitted here: no PID namespace to be PID 1 in")
    harness = _script(tmp_path, "leave", """
        import subprocess, sys
        sys.stdin.read()
        subprocess.Popen(["sleep", "300"])
        print(0.5)
    """)
    trainer = _script(tmp_path, "trainer", PID1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", *trainer, *harness], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0"]


def test_no_harness_process_outlives_a_killed_trainer(tmp_path):
    """``kill -9`` of the trainer mid-episode: the command and the helper it started in its own session end too."""
    pids = tmp_path / "pids"
    harness = _script(tmp_path, "hang", """
        import json, os, subprocess, sys, time
        task = json.load(sys.stdin)
        helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
        with open(task["pids"] + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {helper.pid}")
        os.rename(task["pids"] + ".tmp", task["pids"])
        time.sleep(300)
    """)
    trainer = _script(tmp_path, "trainer", f"""
        import sys
        from esopt_mp.agent.harness_run import command_job, Slot
        command_job({harness!r}, "http://127.0.0.1:9/v1", "m", "", {{"pids": {str(pids)!r}}}, 0.0)(Slot())
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(trainer, env=dict(os.environ, PYTHONPATH=root))
    try:
        deadline = time.monotonic() + 120
        while not pids.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the harness never started"
            time.sleep(0.05)
        left = [int(p) for p in pids.read_text().split()]
        assert all(_state(p) not in (None, "Z") for p in left)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _gone(left)


# ---------------------------------------------------------------- environment
def test_a_command_gets_a_documented_environment_never_secrets_nor_the_launchers_rendezvous(tmp_path):
    environ = {"PATH": "/bin", "HOME": "/home/u", "LC_ALL": "C.UTF-8", "HF_TOKEN": "hf_secret",
               "WANDB_API_KEY": "w", "RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
               "TORCHELASTIC_RUN_ID": "r", "LOCAL_RANK": "1", "OPENAI_API_KEY": "sk-user", "OPENAI_BASE_URL":
               "https://api.openai.com/v1", "JUDGE_KEY": "j"}
    env = harness_env("http://127.0.0.1:5/e/t/v1", "member-1-2", "", ("JUDGE_KEY", "RANK"), environ=environ)
    assert env == {"PATH": "/bin", "HOME": "/home/u", "LC_ALL": "C.UTF-8", "JUDGE_KEY": "j",
                   "OPENAI_BASE_URL": "http://127.0.0.1:5/e/t/v1", "OPENAI_API_KEY": "none",
                   "OPENAI_MODEL": "member-1-2", "ESOPT_BASE_URL": "http://127.0.0.1:5/e/t/v1",
                   "ESOPT_API_KEY": "none", "ESOPT_MODEL": "member-1-2"}
    user = harness_env("http://127.0.0.1:5/e/t/v1", "member-1-2", "k", (), "user", environ=environ)
    assert (user["OPENAI_API_KEY"], user["OPENAI_BASE_URL"]) == ("sk-user", "https://api.openai.com/v1")
    assert "OPENAI_MODEL" not in user and user["ESOPT_API_KEY"] == "k"

    seen = tmp_path / "env.json"
    argv = _script(tmp_path, "env", f"""
        import json, os, sys
        sys.stdin.read()
        json.dump(dict(os.environ), open({str(seen)!r}, "w"))
        print(1)
    """)
    old = {k: os.environ.get(k) for k in ("HF_TOKEN", "MASTER_PORT", "JUDGE_KEY")}
    os.environ.update(HF_TOKEN="hf_secret", MASTER_PORT="29500", JUDGE_KEY="j")
    try:
        assert _play(argv, passed=("JUDGE_KEY",)).ret == 1.0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    got = json.loads(seen.read_text())
    assert got["JUDGE_KEY"] == "j" and got["OPENAI_MODEL"] == "member-0-0"
    assert "HF_TOKEN" not in got and "MASTER_PORT" not in got


@pytest.mark.parametrize("over,line", [
    ({"env": ["MASTER_ADDR"]}, "objective.env: MASTER_ADDR is the launcher's rendezvous variable"),
    ({"env": ["TORCHELASTIC_RUN_ID"]}, "objective.env: TORCHELASTIC_RUN_ID is the launcher's rendezvous variable"),
    ({"env": ["OPENAI_API_KEY"]}, "objective.env: OPENAI_API_KEY names the member being served; "
                                  "objective.openai_env=user"),
    ({"env": ["A=1"]}, "objective.env: lists the names of the trainer's environment variables"),
    ({"openai_env": "judge"}, "objective.openai_env: must be 'member'"),
    ({"concurrency": 300}, "objective.concurrency: 300 episodes at once would hold more connections than "
                           "endpoint.max_connections=256"),
])
def test_environment_settings_are_refused_in_one_line(over, line):
    with pytest.raises(ConfigError) as e:
        build_config({"objective": {"name": "harness", "command": "echo", **over}})
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_stderr_is_kept_on_one_escaped_line(tmp_path):
    """Model text on stderr cannot forge a line of the trainer's log: its line breaks, escape sequences and
    bidirectional overrides are written as escapes."""
    argv = _script(tmp_path, "forge", r"""
        import sys
        sys.stdin.read()
        sys.stderr.write("oops\n2026-12-03 INFO esopt_mp.trainer: step 9 | return 1.000\x1b[2K\u202e\r")
        sys.exit(1)
    """)
    out = _play(argv)
    assert out.failure == "model" and "\n" not in out.error and "\x1b" not in out.error and "\r" not in out.error
    assert out.error == ("exited 1; stderr: oops\\n2026-12-03 INFO esopt_mp.trainer: step 9 | return 1.000"
                         "\\x1b[2K\\u202e")


def test_a_command_starts_as_from_a_shell_its_own_group_and_default_signals(tmp_path):
    """A shell harness as a shell starts it: SIGPIPE at its default (`yes | head -n 1` ends quietly; ignored, `yes`
    would complain of a broken pipe, and some writers loop for ever) and a process group of its own, so one that
    signals its whole group (`kill 0`) to clean up, itself ignoring the signal, keeps its return."""
    script = tmp_path / "shell_like.sh"
    script.write_text(textwrap.dedent("""\
        cat > /dev/null
        err=$( { yes | head -n 1 > /dev/null; } 2>&1 )
        [ -z "$err" ] || { echo "pipe: $err" >&2; exit 3; }
        pgrp=$(cut -d' ' -f5 /proc/$$/stat)
        [ "$pgrp" = "$$" ] || { echo "group $pgrp, not its own" >&2; exit 4; }
        sleep 300 &
        trap '' TERM
        kill -TERM 0
        echo 0.5
    """))
    out = _play(["sh", str(script)])
    assert (out.ret, out.failure, out.error) == (0.5, None, None)
