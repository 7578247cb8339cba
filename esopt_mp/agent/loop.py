"""The batched multi-turn agent loop: one generation batch per turn across all live episodes.

Environments run where the loop runs: on the TP leader of a tensor-parallel group, whose engine
(:class:`esopt_mp.engine.tp.TPEngine`, inside its ``lead``) brings the peers along to every generation.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time

from esopt_mp.chat.format import ChatFormatError, build_chat_format, clean_text
from esopt_mp.engine.base import Engine, SamplingParams, generate_capped
from esopt_mp.core.errors import InfraError
from esopt_mp.core.types import Episode
from esopt_mp.envs.base import call_envs, failure_return, returns_sum
from esopt_mp.envs.config import EnvConfig, check_episode_limits
from esopt_mp.runfiles import open_run_file

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The loop's settings; the defaults and the checks are the ``env`` section's (:mod:`esopt_mp.envs.config`)."""
    max_turns: int = EnvConfig.max_turns
    sampling: SamplingParams = SamplingParams()
    episode_timeout_s: float = EnvConfig.episode_timeout_s  # reset to last step, the batch's generation included
    max_episode_tokens: int = EnvConfig.max_episode_tokens  # prompt + generated tokens of one trajectory (0: none)
    env_workers: int = EnvConfig.env_workers  # threads for a batch's env calls (0: esopt_mp.envs.base.default_workers())

    def __post_init__(self):
        check_episode_limits(self.episode_timeout_s, self.max_episode_tokens, self.env_workers)


def build_agent_config(env_cfg, sampling: SamplingParams) -> AgentConfig:
    """The loop's settings from the ``env`` section, for every trainer (ES, GRPO, PPO): only ``sampling`` differs."""
    return AgentConfig(env_cfg.max_turns, sampling, episode_timeout_s=env_cfg.episode_timeout_s,
                       max_episode_tokens=env_cfg.max_episode_tokens, env_workers=env_cfg.env_workers)


_NOT_RECORDED = ("token_ids", "spans", "ret", "floor")


def episode_record(ep: Episode) -> dict:
    """The trajectory record of an episode (turns are JSON already: no deep copy, which a deep ``info`` would
    recurse in); its return is null where the infrastructure failed it."""
    d = {f.name: getattr(ep, f.name) for f in dataclasses.fields(ep) if f.name not in _NOT_RECORDED}
    d["return"] = None if math.isnan(ep.ret) else ep.ret
    if ep.retried is None:
        d.pop("retried")
    return d


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_episodes(engine: Engine, envs: list, tasks: list[dict], seeds: list[int], cfg: AgentConfig,
                 contexts: list[str] | None = None, members: list[int] | None = None) -> list[Episode]:
    """Play one episode per (env, task) concurrently (at tp > 1: on the TP leader, inside ``engine.lead``).

    With ``cfg.max_episode_tokens`` each turn may generate at most what the budget leaves after the
    conversation so far and the turn's prompt; an episode whose next prompt leaves no room ends as
    ``token_budget`` with the return of its last step (the env's score of an unfinished episode; 0
    before any turn). ``contexts``: per episode, text appended to the opening system message (a new one
    if the env sends none); '' adds nothing. This is where a prompt optimiser's current context reaches
    the model. ``members``: per episode, its member's slot in the engine's batch of members (es.member_batch);
    None: every episode plays the weights as they are.
    """
    tok = engine.tokenizer
    chat = build_chat_format(tok)  # ChatML, or the model's own template (the engine stops replies as it says)
    episodes = [Episode(str(t.get("id", i))) for i, t in enumerate(tasks)]
    convs = [engine.new_conversation(i, s) if members is None else engine.new_conversation(i, s, member=members[i])
             for i, s in enumerate(seeds)]
    start = [time.perf_counter()] * len(tasks)
    new_ids, prompts, history, live = {}, {}, {}, []
    resets = call_envs([(env, "reset", task) for env, task in zip(envs, tasks)], cfg.env_workers)  # at once if allowed
    for i, (out, err, secs) in enumerate(resets):
        start[i] = time.perf_counter() - secs
        if err is not None:  # any env failure marks the episode, never the step; reset sees no model text
            _fail(episodes[i], f"reset: {type(err).__name__}: {err}", "infra", envs[i])
            continue
        msgs, _ = out
        if contexts and contexts[i]:
            msgs = inject_context(msgs, contexts[i])
        prompts[i], history[i] = chat.opening(msgs), list(msgs)
        new_ids[i] = _encode(tok, prompts[i])
        if _left(cfg, convs[i], new_ids[i]) < 1:
            _out_of_tokens(episodes[i], 0.0, time.perf_counter() - start[i])
            continue
        live.append(i)
    budget = [min(cfg.max_turns, getattr(env, "max_turns", cfg.max_turns)) for env in envs]
    sums = [returns_sum(env) for env in envs]
    total = [0.0] * len(envs)
    while live:
        caps = [_left(cfg, convs[i], new_ids[i]) for i in live] if cfg.max_episode_tokens else None
        starts = [len(convs[i].ids) + len(new_ids[i]) for i in live]
        gens = generate_capped(engine, [convs[i] for i in live], [new_ids[i] for i in live], cfg.sampling, caps)
        nxt = []
        steps = call_envs([(envs[i], "step", g.text) for i, g in zip(live, gens)], cfg.env_workers)
        for i, g, s0, (out, err, env_s) in zip(live, gens, starts, steps):
            ep = episodes[i]
            ep.spans.append((s0, s0 + len(g.token_ids)))
            if err is not None:  # the model's text made the env fail, unless the env says its infrastructure did
                kind = "infra" if isinstance(err, InfraError) else "model"
                _fail(ep, f"step {len(ep.turns) + 1}: {type(err).__name__}: {err}", kind, envs[i])
                continue
            try:  # what the env returned for the model's reply, recorded and turned into the next prompt
                msgs, reward, term, trunc, info = out
                reward = float(reward)
                if not math.isfinite(reward):  # a reward that cannot be ranked: the episode is lost, not left out
                    raise ValueError(f"the environment's reward is {reward}")
                if sums[i]:  # the env's return is the sum of its step rewards (dense rewards)
                    total[i] += reward
                ep.turns.append({"prompt": prompts[i], "prompt_tokens": len(new_ids[i]), "response": g.text,
                                 "response_tokens": len(g.token_ids), "finish": g.finish,
                                 "prefill_tokens": g.prefill_tokens, "gen_s": g.seconds, "env_s": env_s,
                                 "reward": reward, "messages": _jsonable(msgs), "info": _jsonable(info)})
                elapsed = time.perf_counter() - start[i]
                if elapsed > cfg.episode_timeout_s:
                    _fail(ep, f"wall clock {elapsed:.1f} s exceeds {cfg.episode_timeout_s:g} s", "wall_clock", envs[i])
                    continue
                if term or trunc or len(ep.turns) >= budget[i]:
                    ep.ret = total[i] if sums[i] else reward
                    ep.ended = "terminated" if term else "truncated" if trunc else "turn_budget"
                    ep.seconds = elapsed
                    continue
                # cleaned: the env may echo the reply's bad text
                prompts[i] = clean_text(chat.delta(history[i], g.token_ids, g.finish, msgs))
                history[i] += [{"role": "assistant", "content": g.text}, *msgs]
                new_ids[i] = _encode(tok, prompts[i])
            except ChatFormatError:  # the model's template and the env's messages do not fit: no episode's fault
                raise
            except Exception as e:  # noqa: BLE001 - what the model's reply made of the env's answer: its failure
                _fail(ep, f"step {len(ep.turns)}: {type(e).__name__}: {e}", "model", envs[i])
                continue
            if _left(cfg, convs[i], new_ids[i]) < 1:
                _out_of_tokens(ep, total[i] if sums[i] else reward, elapsed)
                continue
            nxt.append(i)
        live = nxt
    for ep, conv in zip(episodes, convs):
        ep.token_ids = list(conv.ids)
    return episodes


def inject_context(messages: list[dict], context: str) -> list[dict]:
    """``messages`` with ``context`` appended to the first system message (or a system message put first)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{context}"
        return out
    return [{"role": "system", "content": context}] + out


def generate_texts(engine: Engine, messages: list[list[dict]], seeds: list[int],
                   sampling: SamplingParams) -> list[str]:
    """One reply to each conversation opening, generated as one batch (at tp > 1 inside ``engine.lead``, which
    releases the peers if this raises before the forward passes); conversation i samples with ``seeds[i]``."""
    convs = [engine.new_conversation(i, s) for i, s in enumerate(seeds)]
    chat = build_chat_format(engine.tokenizer)
    ids = [_encode(engine.tokenizer, chat.opening(m)) for m in messages]
    return [g.text for g in engine.generate(convs, ids, sampling)]


def _left(cfg: AgentConfig, conv, new_ids: list[int]) -> int:
    """Tokens the episode may still generate this turn: the per-turn cap, less when the budget is nearer."""
    if not cfg.max_episode_tokens:
        return cfg.sampling.max_new_tokens
    return min(cfg.sampling.max_new_tokens, cfg.max_episode_tokens - len(conv.ids) - len(new_ids))


def _out_of_tokens(ep: Episode, ret: float, seconds: float) -> None:
    ep.ret, ep.ended, ep.seconds = ret, "token_budget", seconds
    log.info("episode %s: token budget spent after %d turns", ep.id, len(ep.turns))


def _fail(ep: Episode, error: str, kind: str, env=None) -> None:
    """End ``ep`` as failed: an infrastructure fault is NaN (left out of the mean), the model's own failure scores
    ``env``'s failure return (counted like a loss, never a free pass)."""
    if kind == "infra":  # the env may not know its failure return yet (a reset that failed): then 0
        try:
            ep.floor = failure_return(env) if env is not None else 0.0
        except Exception:  # noqa: BLE001
            ep.floor = 0.0
        ep.ret = math.nan
    else:
        ep.ret = ep.floor = failure_return(env)
    ep.ended, ep.error, ep.failure = "failed", error, kind
    log.warning("episode %s failed (%s): %s", ep.id, kind, error)


def _jsonable(x):
    """``x`` as JSON can hold it (other objects as their ``str``); a value nested too deeply to copy, or that cannot
    be turned into JSON at all, is recorded as a note instead (the episode goes on)."""
    try:
        return json.loads(json.dumps(x, default=str))
    except (RecursionError, TypeError, ValueError) as e:
        return {"unrecorded": f"{type(e).__name__}: {str(e)[:200]}"}


def write_trajectories(path: str, episodes: list[Episode], **extra) -> None:
    """Append one JSON line per episode (its turns, return, why it ended); a symbolic link at ``path`` is refused."""
    with open_run_file(path, "a") as f:
        for ep in episodes:
            row = {**extra, **episode_record(ep)}
            try:
                line = json.dumps(row)
            except (RecursionError, ValueError) as e:  # a turn's info too deep for JSON: the record without infos
                turns = [{**t, "info": {"unrecorded": type(e).__name__}} for t in row["turns"]]
                line = json.dumps({**row, "turns": turns})
            f.write(line + "\n")
