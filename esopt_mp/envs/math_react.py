"""ReAct math with a sandboxed ``python`` tool; answers checked symbolically (math-verify).

The agent reasons, may call ``python`` (Qwen3.5 XML or Hermes JSON tool calls)
whose code runs in :class:`~esopt_mp.envs.sandbox.Sandbox`, and ends with
``\\boxed{answer}`` (or a last line ``Answer: ...``). Reward 1 for a correct
final answer, else 0. Tasks: a procedural generator (nothing to download) and
JSONL ``{id, question, answer}`` files such as the paper's DAPO / AIME 2026 splits.
"""
from __future__ import annotations

import json
import random
import re

from esopt_mp.chat.toolcalls import MAX_CALLS, build_parser
from esopt_mp.envs.spec import EnvSpec
from esopt_mp.envs.sandbox import Sandbox, SandboxConfig, SandboxLimits

SYSTEM = ("Solve the problem. You may run Python with the `python` tool: "
          "<tool_call>\n<function=python>\n<parameter=code>\n...\n</parameter>\n</function>\n</tool_call>. "
          "Give the final answer as \\boxed{...}.")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")
_ANSWER_LINE = re.compile(r"^[ \t]*Answer:[ \t]*\n?[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)  # linear in the text


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{...}``, else the last ``Answer: ...`` line."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    lines = _ANSWER_LINE.findall(text)
    return lines[-1].strip().strip("$") if lines else None


def answers_match(given: str, reference: str) -> bool:
    """Symbolic equivalence via math-verify, checked in a worker process within a bounded time: the same verdict
    on a batch's env threads as on the main thread (math-verify's own timeout works on the main thread only)."""
    from esopt_mp.envs.answers import answers_match as check

    return check(given, reference)


def generate(n: int, seed: int = 0) -> list[dict]:
    """Procedural arithmetic and word problems with integer answers."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = rng.randrange(4)
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
        if kind == 0:
            q, ans = f"What is {a} * {b} - {c}?", a * b - c
        elif kind == 1:
            q, ans = f"What is the sum of the integers from {c} to {c + a}?", sum(range(c, c + a + 1))
        elif kind == 2:
            q = f"A box holds {c} apples. How many apples are in {a} boxes plus {b} loose apples?"
            ans = a * c + b
        else:
            q, ans = f"What is the remainder when {a ** 3 + b} is divided by {c}?", (a ** 3 + b) % c
        rows.append({"id": f"arith-s{seed}-{i:05d}", "question": q, "answer": str(ans)})
    return rows


def load_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                for key in ("question", "answer"):
                    if key not in row:
                        raise ValueError(f"{path}: row {row.get('id', i)} lacks {key!r}")
                row["answer"] = str(row["answer"])
                row.setdefault("id", f"{path}:{i}")
                rows.append(row)
    return rows


class MathReactEnv:
    name = "math_react"

    def __init__(self, max_turns: int = 50, parser: str = "any", sandbox: Sandbox | SandboxConfig | None = None,
                 limits: SandboxLimits | None = None):
        self.max_turns = max_turns
        self.parser = build_parser(parser)
        # a ready Sandbox, or this environment's sub-config (``env.sandbox``) applied over its own default limits
        self.sandbox = sandbox if isinstance(sandbox, Sandbox) else Sandbox.from_config(
            sandbox, limits or SandboxLimits(wall_s=10, output_bytes=8192))
        # each tool call is its own sandbox process: a batch's calls run side by side (call_envs), except at the
        # rlimit level without root, where concurrent calls would share one uid's process limit
        self.concurrent = self.sandbox.root or self.sandbox.level != "rlimit"
        self.task = None

    def reset(self, task: dict):
        self.task, self.turn = task, 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}], {
            "id": task.get("id"), "sandbox": self.sandbox.level}

    def step(self, assistant_text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        calls = self.parser.parse(assistant_text)
        info = {"tool_calls": [c.__dict__ for c in calls], "tool_results": []}
        if calls:
            msgs = []
            for k, call in enumerate(calls):
                if k >= MAX_CALLS:  # each call may take the sandbox's wall clock: a turn stays bounded
                    out = f"not run: at most {MAX_CALLS} tool calls per turn"
                elif call.error:
                    out = call.error
                elif call.name != "python" or not isinstance(call.arguments.get("code"), str):
                    out = (f"unknown tool {call.name[:80]!r} or missing 'code' text parameter; the only tool is "
                           "python(code)")
                else:
                    res = self.sandbox.run_python(call.arguments["code"])
                    out = res.stdout + (f"\n[error] {res.error}" if res.error else "")
                    info["tool_results"].append({"ok": res.ok, "error": res.error, "seconds": res.seconds})
                msgs.append({"role": "tool", "content": out[-4000:]})
            return msgs, 0.0, False, self.turn >= self.max_turns, info
        answer = extract_answer(assistant_text)
        if answer is not None:
            correct = answers_match(answer, self.task["answer"])
            info.update(answer=answer, correct=correct)
            return [], float(correct), True, False, info
        info["feedback"] = "no tool call and no final answer"
        msg = {"role": "user", "content": "Call the python tool or give the final answer as \\boxed{...}."}
        return [msg], 0.0, False, self.turn >= self.max_turns, info


class MathReactSpec(EnvSpec):
    """No section of its own: the tasks are the generator's or a JSONL file's, the tool runs in ``env.sandbox``."""

    runs_code = True

    def build(self, section, *, max_turns, sandbox=None):
        return MathReactEnv(max_turns, sandbox=sandbox)

    def make(self, sandbox=None, **kwargs):
        return MathReactEnv(sandbox=sandbox, **kwargs)

    def tasks(self, section, split, n, seed):
        return generate(n, seed=seed)

    def load(self, section, path, n):
        return load_jsonl(path)[:n]

    def task_key(self, task):
        return str(task.get("question", task.get("seed")))


SPEC = MathReactSpec()
