"""DocVQA as the paper runs it: a text agent with a sandboxed ``bash`` tool OCRs a document image; ANLS reward.

The agent never sees pixels: the page is ``/workspace/document.png`` (read-only) in the sandbox, and its ``bash``
calls (Qwen3.5 XML or Hermes JSON, parsed as math_react parses ``python``) run there with the sandbox's limits and
no network, with the system's ``tesseract`` and ``imgtool`` (crop / scale / threshold, Pillow) to zoom before OCR.
Each call starts from a fresh workspace holding only the document (chain steps with ``&&`` in one call). Under
bwrap ``/workspace`` is the call's private /tmp; at the Landlock levels (no mount namespace) the literal path
``/workspace`` in a command is rewritten to the call's scratch directory, which is also ``$WORKSPACE`` and the cwd.
Protocol: a final answer before any tool observation is rejected (the episode goes on); the last ``Final answer:``
/ ``Answer:`` line counts; the reward is its ANLS against the accepted answers; no tool use or no final answer
scores 0. Tasks: JSONL ``{id, question, answers, image}`` (public DocVQA; ``questionId`` is read as ``id``), or
:mod:`.docvqa_gen`'s synthetic documents.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import weakref

from esopt_mp.envs.anls import THRESHOLD, anls, extract_final_answer, normalize
from esopt_mp.envs.spec import EnvSpec
from esopt_mp.envs.sandbox import Sandbox, SandboxConfig, SandboxLimits
from esopt_mp.envs.docvqa_config import DocVQAConfig, resolve_tesseract
from esopt_mp.envs.sandbox.core import WORKSPACE
from esopt_mp.chat.toolcalls import MAX_CALLS, build_parser

DOC = "document.png"
SYSTEM = (f"Answer the question about the document image {WORKSPACE}/{DOC}. You cannot see it: inspect it with the "
          "`bash` tool, which runs one shell command in a fresh, isolated copy of the workspace (no network). "
          "`tesseract IMAGE -` prints the text of an image; `imgtool crop|scale|threshold|info` zooms into a region "
          "first (run `imgtool` for usage). Call it as:\n<tool_call>\n<function=bash>\n<parameter=command>\n"
          f"tesseract {WORKSPACE}/{DOC} -\n</parameter>\n</function>\n</tool_call>\n"
          "When you know the answer, end with one line `Final answer: <short answer>` copied from the document.")
_RUNNER = """import os, re, sys
cmd, tool, tess, alias = {cmd!r}, {tool!r}, {tess!r}, {alias!r}
here = os.getcwd()
os.makedirs('.bin', exist_ok=True)
with open('.bin/imgtool', 'w') as f:
    f.write('#!/usr/bin/env python3\\n' + tool)  # the sandbox's python3: the trainer's interpreter
os.chmod('.bin/imgtool', 0o755)
if os.path.basename(tess) != 'tesseract' or os.path.dirname(tess) not in ('/usr/bin', '/bin'):
    os.symlink(tess, '.bin/tesseract')
if alias:  # the path itself and paths under it, not /workspaces/x, /workspace2 or /x/workspace
    cmd = re.sub(r'(?<![\\w.~/$-])' + re.escape({ws!r}) + r'(?![\\w.~+-])', lambda m: here, cmd)
env = dict(os.environ, PATH=here + '/.bin:' + os.environ['PATH'], HOME=here, TMPDIR=here, OMP_THREAD_LIMIT='1',
           WORKSPACE=here)  # the sandbox's environment: its python3 and the trainer's PYTHONPATH
os.execve('/bin/bash', ['bash', '-c', cmd], env)
"""


def clip(text: str, limit: int) -> str:
    """At most ``limit`` characters of a tool's output plus a marker: its head and its tail (a page's OCR starts
    with the title and ends with totals), the middle elided with the count said."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters elided ...]\n{text[len(text) - tail:]}"


def load_jsonl(path: str) -> list[dict]:
    """DocVQA rows; each ``image`` resolved against the file's directory, required to exist and to lie inside it
    (symbolic links resolved): a row cannot have the trainer copy any other file into the sandbox."""
    base, rows = os.path.dirname(os.path.abspath(path)), []
    real_base = os.path.realpath(base)
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            rid = row.get("id", row.get("questionId", f"{path}:{i}"))
            for key in ("question", "answers", "image"):
                if key not in row:
                    raise ValueError(f"{path}: row {rid} lacks {key!r}")
            answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
            if not answers:
                raise ValueError(f"{path}: row {rid} has no accepted answers")
            bad = [a for a in answers if not isinstance(a, str) or not normalize(a)]
            if bad:  # "" would accept any punctuation; None / numbers are not DocVQA answers
                raise ValueError(f"{path}: row {rid}: accepted answers must be strings with a letter or digit, "
                                 f"got {bad!r}")
            if not isinstance(row["image"], str) or not row["image"]:
                raise ValueError(f"{path}: row {rid}: image must be a path relative to the file, got {row['image']!r}")
            image = os.path.realpath(os.path.join(base, row["image"]))
            if os.path.commonpath([image, real_base]) != real_base:
                raise ValueError(f"{path}: row {rid}: image {row['image']!r} is outside the dataset's folder "
                                 f"{real_base} (rows may only name images inside it)")
            if not os.path.isfile(image):
                raise FileNotFoundError(f"{path}: row {rid}: image {image} does not exist (DocVQA images are not "
                                        "downloaded; put them next to the JSONL as its 'image' paths say)")
            rows.append({**row, "id": str(rid), "answers": list(answers), "image": image})
    return rows


def _copy_checked(image: str, page: str, tid) -> None:
    """Copy the image that was checked when the rows were read (rows hold resolved paths): the file opened, with no
    link followed at the end, must still be that path, so a link or folder swapped in since names no other file."""
    try:
        fd = os.open(image, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"task {tid}: image {image} cannot be opened without following a link: {e}") from None
    with os.fdopen(fd, "rb") as src:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if opened != image:
            raise ValueError(f"task {tid}: image {image} now resolves to {opened}, not the file its row named")
        with open(page, "wb") as dst:
            shutil.copyfileobj(src, dst)


class DocVQAEnv:
    name = "docvqa"

    def __init__(self, max_turns: int = 50, parser: str = "any", sandbox: Sandbox | SandboxConfig | None = None,
                 limits: SandboxLimits | None = None, docvqa: DocVQAConfig | None = None):
        self.max_turns, self.cfg = max_turns, docvqa or DocVQAConfig()
        self.parser = build_parser(parser)
        self.tesseract = resolve_tesseract(self.cfg.tesseract)
        self.sandbox = sandbox if isinstance(sandbox, Sandbox) else Sandbox.from_config(
            sandbox, limits or SandboxLimits(wall_s=30, cpu_s=30, memory_mb=2048, output_bytes=16384))
        # each tool call is its own sandbox process: a batch's calls run side by side (call_envs), except at the
        # rlimit level without root, where concurrent calls would share one uid's process limit
        self.concurrent = self.sandbox.root or self.sandbox.level != "rlimit"
        with open(os.path.join(os.path.dirname(__file__), "docvqa_imgtool.py")) as f:
            self._tool = f.read()
        self._dir = tempfile.mkdtemp(prefix="esopt_docvqa_")  # this episode's private copy of the page
        os.chmod(self._dir, 0o755)  # readable by the sandbox's per-call uid (root runs)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self.task = None

    def close(self) -> None:
        self._cleanup()

    def reset(self, task: dict):
        if not os.path.isfile(task["image"]):
            raise FileNotFoundError(f"task {task.get('id')}: image {task['image']} does not exist")
        self.task, self.turn, self.observed = task, 0, False
        page = os.path.join(self._dir, DOC)
        if os.path.exists(page):
            os.remove(page)  # the last episode's read-only copy
        _copy_checked(task["image"], page, task.get("id"))
        os.chmod(page, 0o444)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}], {
            "id": task.get("id"), "sandbox": self.sandbox.level}

    def run_bash(self, command: str):
        """One ``bash -c command`` in the sandbox, the page at /workspace/document.png (and ./document.png)."""
        if self.task is None:
            raise RuntimeError("run_bash() before reset(): there is no document yet")
        code = _RUNNER.format(cmd=command, tool=self._tool, tess=self.tesseract, ws=WORKSPACE,
                              alias=self.sandbox.level != "bwrap")
        return self.sandbox.run_python(code, files={DOC: os.path.join(self._dir, DOC)})

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        calls = self.parser.parse(assistant_text)
        info = {"tool_calls": [c.__dict__ for c in calls], "tool_results": []}
        out_of_turns = self.turn >= self.max_turns
        if calls:  # an answer written next to a call comes before that call's observation: ignored
            msgs = []
            for k, call in enumerate(calls):
                command = call.arguments.get("command", call.arguments.get("cmd"))
                if k >= MAX_CALLS:  # each call may take the sandbox's wall clock: a turn stays bounded
                    out = f"not run: at most {MAX_CALLS} tool calls per turn"
                elif call.error:
                    out = call.error
                elif call.name != "bash" or not isinstance(command, str):
                    out = f"unknown tool {call.name!r} or missing 'command' parameter; the only tool is bash(command)"
                else:
                    res = self.run_bash(command)
                    self.observed = True
                    out = res.stdout + res.stderr[-1000:] + (f"\n[error] {res.error}" if res.error else "")
                    info["tool_results"].append({"ok": res.ok, "error": res.error, "seconds": res.seconds})
                msgs.append({"role": "tool", "content": clip(out, self.cfg.observation_chars)})
            return msgs, 0.0, False, out_of_turns, info
        answer = extract_final_answer(assistant_text)
        if answer is not None and self.observed:
            score = anls(answer, self.task["answers"])
            info.update(answer=answer, anls=score, correct=score > THRESHOLD)
            return [], score, True, False, info
        if answer is not None:
            info.update(answer=answer, rejected="final answer before any tool observation")
            text = "Answer rejected: inspect the document with the bash tool before answering."
        else:
            info["feedback"] = "no tool call and no final answer"
            text = "Call the bash tool, or end with a line `Final answer: <short answer>`."
        return [{"role": "user", "content": text}], 0.0, False, out_of_turns, info


class DocVQASpec(EnvSpec):
    """``env.docvqa``: tesseract, where generated documents go, how much of a tool's output the agent sees."""

    config = DocVQAConfig
    runs_code = True

    def build(self, section, *, max_turns, sandbox=None):
        return DocVQAEnv(max_turns, sandbox=sandbox, docvqa=section)

    def make(self, sandbox=None, **kwargs):
        return DocVQAEnv(sandbox=sandbox, **kwargs)

    def tasks(self, section, split, n, seed):
        from esopt_mp.envs.docvqa_gen import generate

        return generate(n, section.generated_dir(), seed=seed)

    def load(self, section, path, n):
        return load_jsonl(path)[:n]

    def task_key(self, task):
        return str((task.get("image"), task.get("question")))  # the page and the question

    def identity(self, section):  # its paths are out
        return {"docvqa": {k: v for k, v in dataclasses.asdict(section).items() if k not in ("tesseract", "gen_dir")}}


SPEC = DocVQASpec()
