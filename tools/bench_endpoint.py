"""The endpoint's throughput: N scripted sessions over HTTP vs the in-process agent loop on the same conversations.

Both play the same N conversations of ``--turns`` turns on the shipped tiny agent, greedy: a system prompt with
Qwen3's tools block, a user question, and after each reply a tool result (role "tool"). Through the endpoint, N
client threads (httpx) send the whole history each turn, as an agent program does, and the member is served in
lockstep batches (``live`` = the clients still playing); in process, :func:`esopt_mp.agent.loop.run_episodes`
plays N :class:`ScriptedToolEnv`. Tokens/s is generated tokens over wall time; ``same_conversations`` says the
two produced the very same token ids (greedy: they must).

Usage: python tools/bench_endpoint.py [--sessions 8] [--turns 3] [--max-new-tokens 16] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import threading
import time

from esopt_mp.profiling.record import print_record

AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "esopt_mp", "assets", "tiny_agent")
SYSTEM = "You play 4x4 Sudoku. Use the tools when they help."
TOOLS = [{"type": "function", "function": {"name": "check", "description": "check a row of the grid",
                                           "parameters": {"type": "object", "properties": {
                                               "row": {"type": "integer"}}, "required": ["row"]}}}]


def question(k: int) -> str:
    return f"Puzzle {k}: 1 . 3 4 / 3 4 . 2 / . 1 4 3 / 4 3 2 . Fill the blanks."


def tool_result(turn: int) -> str:
    return f"row {turn} checked: {turn} blank(s) left"


class ScriptedToolEnv:
    """The in-process side: the endpoint client's conversation as an environment (tool results as role "tool")."""

    def __init__(self, turns: int = 3):
        self.turns, self.t = turns, 0

    def reset(self, task):
        from esopt_mp.endpoint.render import system_with_tools

        self.t = 0
        return system_with_tools([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": task["question"]}], TOOLS), {}

    def step(self, text):
        self.t += 1
        if self.t >= self.turns:
            return [], 1.0, True, False, {}
        return [{"role": "tool", "content": tool_result(self.t)}], 0.0, False, False, {}


def play_client(base_url: str, model: str, task: dict, turns: int = 3, client=None,
                http=None) -> tuple[list[dict], int]:
    """A scripted agent program: the whole history each turn, a tool result after each reply but the last.
    (messages, completion tokens); ``client``: an ``openai.OpenAI`` to use instead of httpx; ``http``: the
    ``httpx.Client`` to send with (one kept open, as an agent program's; default: one per request)."""
    steps = session_steps(base_url, model, task, turns, client, http)
    for out in steps:
        pass
    return out


def session_steps(base_url: str, model: str, task: dict, turns: int = 3, client=None, http=None):
    """:func:`play_client` one request at a time: yields (messages so far, completion tokens so far) after each."""
    import httpx

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    tokens = 0
    for t in range(1, turns + 1):
        if client is not None:
            r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS)
            msg, used = r.choices[0].message.model_dump(exclude_none=True), r.usage.completion_tokens
        else:
            r = (http or httpx).post(f"{base_url}/chat/completions", timeout=300,
                                     json={"model": model, "messages": msgs, "tools": TOOLS})
            r.raise_for_status()
            body = r.json()
            msg, used = body["choices"][0]["message"], body["usage"]["completion_tokens"]
        msgs.append(msg)
        tokens += used
        if t < turns:
            calls = msg.get("tool_calls") or [{"id": f"call_{t}"}]
            msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": tool_result(t)})
        yield msgs, tokens


def through_endpoint(server, engine, tasks, seeds, sampling, turns, model="member-0-0"):
    """(conversation ids per session, generated tokens, seconds) of N client threads against ``server``."""
    import httpx

    running = [len(tasks)]
    https = [httpx.Client() for _ in tasks]  # each session's connection, made before the clock starts
    lock = threading.Lock()
    tokens, errors = [0] * len(tasks), []

    with server.member(model, seeds, sampling) as m:
        def session(k):
            try:
                tokens[k] = play_client(m.routes[k].base_url, model, tasks[k], turns, http=https[k])[1]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"session {k}: {type(e).__name__}: {e}")
            finally:
                with lock:
                    running[0] -= 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=session, args=(k,), daemon=True) for k in range(len(tasks))]
        for th in threads:
            th.start()
        m.serve(engine, live=lambda: running[0], until=lambda: running[0] == 0)
        seconds = time.perf_counter() - t0
        for th in threads:
            th.join(60)
        for h in https:
            h.close()
        if errors:
            raise RuntimeError("; ".join(errors))
        ids = [list(r.sessions.threads[0].conv.ids) for r in m.routes]
        opened = [len(r.sessions.threads) for r in m.routes]
    if opened != [1] * len(tasks):
        raise RuntimeError(f"sessions opened more than one conversation each: {opened}")
    return ids, sum(tokens), seconds


def in_process(engine, tasks, seeds, sampling, turns):
    """(conversation ids per episode, generated tokens, seconds) of the agent loop on the same conversations."""
    from esopt_mp.agent.loop import AgentConfig, run_episodes

    cfg = AgentConfig(max_turns=turns, sampling=sampling)
    t0 = time.perf_counter()
    eps = run_episodes(engine, [ScriptedToolEnv(turns) for _ in tasks], tasks, seeds, cfg)
    seconds = time.perf_counter() - t0
    return [e.token_ids for e in eps], sum(t["response_tokens"] for e in eps for t in e.turns), seconds


def run(sessions: int = 8, turns: int = 3, max_new_tokens: int = 16, repeats: int = 2) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esopt_mp.endpoint import EndpointConfig, EndpointServer
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams

    tok = AutoTokenizer.from_pretrained(AGENT)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(AGENT).eval(), tok)
    sampling = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=max_new_tokens)
    tasks = [{"id": str(k), "question": question(k)} for k in range(sessions)]
    seeds = list(range(sessions))
    best = {"endpoint": None, "in_process": None}
    same = True
    with EndpointServer(EndpointConfig(batch_window_s=1.0), tok) as server:
        for _ in range(repeats):  # interleaved rounds; each variant's best
            with torch.no_grad():
                a = through_endpoint(server, engine, tasks, seeds, sampling, turns)
                b = in_process(engine, tasks, seeds, sampling, turns)
            same = same and a[0] == b[0]
            for name, (_, n, s) in (("endpoint", a), ("in_process", b)):
                if best[name] is None or s < best[name]["seconds"]:
                    best[name] = {"tokens": n, "seconds": s, "tokens_per_s": n / s}
    return {"sessions": sessions, "turns": turns, "max_new_tokens": max_new_tokens, "repeats": repeats,
            "model": "esopt_mp/assets/tiny_agent", "same_conversations": same, **best,
            "endpoint_over_in_process": best["endpoint"]["tokens_per_s"] / best["in_process"]["tokens_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(prog=os.environ.get("ESOPT_PROG"), description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    print_record("endpoint", run(a.sessions, a.turns, a.max_new_tokens, a.repeats))


if __name__ == "__main__":
    main()
