"""A scripted agent harness for ``objective=harness``: three chat turns with a calculator tool, scored by how close
the member's answers come to the task's answer.

Use it either way (docs/harness.md):

    python launch/train.py objective=harness objective.callable=scripted_harness:play   # examples/ on PYTHONPATH
    python launch/train.py objective=harness "objective.command=python examples/scripted_harness.py"

The conversation opens with one worked tool call (the assistant asked the calculator, the tool answered), so the
member sees how a call and its result look; then the member has three turns. A reply that calls the calculator is
answered by the tool; any other reply gets the next scripted user message. The return is the mean fuzzy match
(``difflib``) of the three replies against the answer: in [0, 1], and it moves with every character the member writes.
"""
from __future__ import annotations

import ast
import difflib
import json
import operator
import os
import sys

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
NUDGES = ["Check the result and give the answer as a number.", "Your final answer, as a number only."]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The tool: arithmetic only (no ``eval``), its error as text the model reads."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / ( )")
    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else value)


def opening(task: dict) -> tuple[list[dict], str]:
    """The first messages (with the worked tool call) and the answer a reply is scored against."""
    expression = str(task.get("expression") or "6 * 7")
    question = task.get("question") or f"What is {expression}?"
    answer = str(task.get("answer") or calculator(expression))
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    return [{"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "Let me compute it.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculator(expression)}], answer


def play(base_url: str, model: str, task: dict) -> float:
    """One episode against the member served at ``base_url``: its return."""
    client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"), max_retries=0)
    messages, answer = opening(task)
    score = 0.0
    for turn in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                               max_tokens=64).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        score += difflib.SequenceMatcher(None, answer, reply.content or "").ratio() / 3
        if reply.tool_calls:  # the member called a tool: answer every call
            for c in reply.tool_calls:
                try:
                    expr = json.loads(c.function.arguments).get("expression", "")
                except (ValueError, AttributeError):
                    expr = c.function.arguments
                messages.append({"role": "tool", "tool_call_id": c.id, "content": calculator(expr)})
        elif turn < 2:
            messages.append({"role": "user", "content": NUDGES[turn]})
    return score


if __name__ == "__main__":  # the command form: the task on stdin, the endpoint in the environment
    print(play(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_MODEL"], json.load(sys.stdin)))
