"""The docvqa environment end to end: bash + tesseract in the sandbox at every level available here.

Scripted agents: one OCRs the page and answers from tesseract's output, one answers without looking; the protocol
(answer before a tool observation rejected, no tool use scores 0); the sandbox battery with bash instead of Python.
Everything skips with the reason when tesseract (Debian tesseract-ocr) is not installed."""
import os
import secrets
import shutil
import socket
import tempfile
import time

import pytest

from esopt_mp.envs import make
from esopt_mp.envs.docvqa_gen import generate
from esopt_mp.envs.sandbox import LEVELS, Sandbox, SandboxLimits, probe

pytestmark = pytest.mark.skipif(shutil.which("tesseract") is None,
                                reason="tesseract not installed (apt-get install tesseract-ocr fonts-dejavu-core)")
LIMITS = SandboxLimits(wall_s=6, cpu_s=3, memory_mb=1024, nproc=16, fsize_mb=4, total_mb=64, output_bytes=8192)
OCR = "tesseract --psm 6 /workspace/document.png - 2>/dev/null"


def call(command: str) -> str:
    return (f"Let me look.\n<tool_call>\n<function=bash>\n<parameter=command>\n{command}\n</parameter>\n"
            "</function>\n</tool_call>")


def hermes(command: str) -> str:
    return '<tool_call>{"name": "bash", "arguments": {"command": "%s"}}</tool_call>' % command


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return generate(16, str(tmp_path_factory.mktemp("docvqa")), seed=11)


@pytest.fixture(scope="module", params=LEVELS)
def env(request, docs):
    why = probe(request.param)
    if why:
        pytest.skip(f"level {request.param} unavailable for uid {os.getuid()}: {why}")
    e = make("docvqa", sandbox=Sandbox(LIMITS, level=request.param))
    e.reset(docs[0])
    return e


def read_answer(ocr: str, task: dict) -> str:
    """What a careful reader of the OCR text answers: the value next to the label the question names."""
    lines = [ln.strip() for ln in ocr.splitlines() if ln.strip()]
    label = task.get("label")
    for ln in lines:
        if "column" in task and ln.split()[:1] == [label]:
            return ln.split()[task["column"]]
        if isinstance(label, str) and "column" not in task and ln.lower().startswith(label.lower() + ":"):
            return ln.split(":", 1)[1].strip()
    return lines[0] if lines else ""


def play(env, task, agent) -> tuple[float, dict]:
    """One episode with a scripted agent: ``agent(observation) -> assistant text``."""
    env.reset(task)
    obs, info = "", {}
    for _ in range(env.max_turns):
        msgs, reward, done, trunc, info = env.step(agent(obs))
        obs = msgs[0]["content"] if msgs else ""
        if done or trunc:
            return reward, info
    return 0.0, info


def test_ocr_agent_scores_well_above_a_blind_agent(env, docs):
    def ocr_agent(task):
        return lambda obs: call(OCR) if not obs else f"Final answer: {read_answer(obs, task)}"

    def blind_agent(task):  # uses the tool (so it is not rejected) but never looks at the page
        return lambda obs: call("echo ready") if not obs else "Final answer: 1234"

    looked = [play(env, t, ocr_agent(t))[0] for t in docs]
    blind = [play(env, t, blind_agent(t))[0] for t in docs]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print({"level": env.sandbox.level, "ocr_anls": mean(looked), "blind_anls": mean(blind), "n": len(docs)})
    assert mean(looked) >= 0.8 and mean(blind) <= 0.1, (mean(looked), mean(blind))


def test_answer_before_any_tool_observation_is_rejected(env, docs):
    task = docs[0]
    env.reset(task)
    msgs, reward, done, trunc, info = env.step(f"Final answer: {task['answers'][0]}")  # right, but unlooked
    assert (reward, done) == (0.0, False) and "rejected" in info and "rejected" in msgs[0]["content"]
    # an answer written next to the first call precedes that call's observation: the call runs, no score
    msgs, reward, done, _, info = env.step(call(OCR) + f"\nFinal answer: {task['answers'][0]}")
    assert (reward, done) == (0.0, False) and msgs[0]["role"] == "tool" and info["tool_results"][0]["ok"]
    msgs, reward, done, _, info = env.step(f"Final answer: {task['answers'][0]}")
    assert (reward, done) == (1.0, True) and info["correct"]


def test_no_tool_use_or_no_final_answer_scores_zero(docs):
    env = make("docvqa", max_turns=3, sandbox=Sandbox(LIMITS))
    assert play(env, docs[1], lambda obs: f"Final answer: {docs[1]['answers'][0]}")[0] == 0.0  # never looked
    reward, info = play(env, docs[1], lambda obs: call(OCR) if not obs else "I am not sure.")
    assert reward == 0.0 and info["feedback"] == "no tool call and no final answer"


def test_hermes_calls_zoom_tools_and_read_only_page(env, docs):
    env.reset(docs[2])
    msgs, *_ = env.step(hermes("imgtool crop document.png top.png 0 0 1 0.3 && imgtool scale top.png big.png 2 "
                               "&& imgtool threshold big.png bw.png && tesseract bw.png - 2>/dev/null"))
    title = read_answer(env.run_bash(OCR).stdout, {"label": None})
    assert title and title in msgs[0]["content"], msgs[0]["content"]
    page = os.path.join(env._dir, "document.png")
    before = open(page, "rb").read()
    env.run_bash("echo x > /workspace/document.png; echo y > document.png; chmod u+w document.png; rm -f document.png")
    assert open(page, "rb").read() == before  # the page cannot be overwritten (at most a call unlinks its own view)
    assert env.run_bash("ls document.png").stdout == "document.png\n"
    assert env.run_bash("ls /workspace/top.png").error  # each call starts from a fresh workspace


def test_only_the_workspace_path_itself_is_rewritten(env, docs):
    """At the Landlock levels /workspace and paths under it are the call's scratch directory; /workspaces/x,
    /workspace2 and /x/workspace are other paths (under bwrap nothing is rewritten: /workspace is a real link)."""
    env.reset(docs[0])
    out = env.run_bash('echo /workspaces/x /workspace2 /x/workspace /workspace "/workspace/document.png" '
                       '/workspace/; echo "$WORKSPACE"').stdout.split("\n")
    words, here = out[0].split(), out[1]
    assert words[:3] == ["/workspaces/x", "/workspace2", "/x/workspace"]
    ws = "/workspace" if env.sandbox.level == "bwrap" else here
    assert words[3:] == [ws, f"{ws}/document.png", f"{ws}/"]
    assert env.run_bash("ls /workspace/document.png").stdout.endswith("document.png\n")


def test_a_long_tool_output_shows_its_head_and_tail(env, docs):
    env.reset(docs[0])
    msgs, *_ = env.step(call("echo HEAD; seq 1 1400; echo TAIL"))  # ~6 KB: under the output cap
    text, limit = msgs[0]["content"], env.cfg.observation_chars
    assert text.startswith("HEAD\n1\n") and text.endswith("1400\nTAIL\n")
    assert "characters elided ...]" in text and len(text) < limit + 60


HOSTILE = {
    "infinite loop": ("while :; do :; done", ("timeout", "cpu limit")),
    # bash itself may exit 0 once its children fail to fork: contained means refused forks and nothing left over
    "fork bomb": ("b() { b | b & }; b; sleep 2", ("timeout", "Resource temporarily unavailable")),
    "10 GB file": ("head -c 10G /dev/zero > big", ("File too large", "exit status")),
    "print 100 MB": ("yes xxxxxxxxxxxxxxxxxxxxxxxxxx | head -c 100M", ("output exceeded",)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bash_is_contained(env, name):
    command, expected = HOSTILE[name]
    # tagged: the same test as another user (CI's non-root stage, at the same time) runs the same commands
    command = f"{command} # {secrets.token_hex(8)}"
    r = env.run_bash(command)
    assert name == "fork bomb" or not r.ok, (env.sandbox.level, r.stdout[-200:])
    assert any(e in (r.error or "") + r.stderr for e in expected), (env.sandbox.level, r.error, r.stderr[-300:])
    assert len(r.stdout) <= LIMITS.output_bytes
    time.sleep(0.3)
    assert not any(command in _cmdline(p) for p in os.listdir("/proc") if p.isdigit())  # nothing left running
    assert env.run_bash("echo still fine").stdout == "still fine\n"


def test_bash_cannot_reach_the_network(env):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        port = srv.getsockname()[1]
        r = env.run_bash(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
    finally:
        srv.close()
    assert "connected" not in r.stdout and not r.ok, (r.stdout, r.error)


def test_bash_cannot_leave_the_workspace(env):
    shared = tempfile.mkdtemp(prefix="esopt_test_")
    try:
        os.chmod(shared, 0o777)
        secret = os.path.join(shared, "secret.txt")
        with open(secret, "w") as f:
            f.write("secret")
        os.chmod(secret, 0o644)
        for path in (secret, "/etc/passwd", os.path.join(env._dir, "..", "esopt_docvqa_x")):
            r = env.run_bash(f"cat {path}")
            assert "secret" not in r.stdout and "root:" not in r.stdout, (path, r.stdout[:80])
        for path in (os.path.join(shared, "new.txt"), f"/tmp/esopt_test_{secrets.token_hex(4)}"):
            env.run_bash(f"echo x > {path}; cd / && echo y > {path}")
            assert not os.path.exists(path), path
    finally:
        shutil.rmtree(shared)


def test_bash_background_job_does_not_outlive_the_call(env):
    tag = f"{secrets.randbelow(1000):03d}"  # digits: sleep refuses a hex fraction (and the test would test nothing)
    shared = tempfile.mkdtemp(prefix="esopt_test_")
    os.chmod(shared, 0o777)
    try:
        r = env.run_bash(f"(setsid nohup sleep 2.{tag} >/dev/null 2>&1; touch {shared}/late) & disown; "
                         "echo started")
        assert r.stdout == "started\n" and r.ok, r.error  # ended with the shell, not at the wall clock
        time.sleep(2.8)
        assert not os.path.exists(os.path.join(shared, "late"))
        assert not any(f"sleep 2.{tag}" in _cmdline(p) for p in os.listdir("/proc") if p.isdigit())
    finally:
        shutil.rmtree(shared)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
