"""Skill synthesis's hooks into the run (``prompt.optimiser=skill``): the proposer and the validation of a candidate
context. They live with the agent because they play episodes; the optimiser itself (``esopt_mp.prompt``) is plain
text.

Both play on the run's unperturbed model through its episode player (:class:`esopt_mp.agent.episodes.EpisodePlayer`):
the trainer updates the context after every member restored its weights.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor

import torch

from esopt_mp.agent.episodes import return_total
from esopt_mp.agent.loop import generate_texts
from esopt_mp.es.seeds import stream_seed
from esopt_mp.prompt.base import context_hash

log = logging.getLogger(__name__)


def skill_hooks(player, cfg) -> dict:
    """``proposer(prompt, step, batch)`` and ``validate(text, step, steps)`` for prompt.optimiser=skill (``cfg``: the
    prompt.skill section).

    The proposal is made once, by dp group 0 (policy: its TP leader with its peers following) or rank 0 (endpoint),
    sampled with the seed (run seed, step, batch), and broadcast: every rank merges the same edits. If the policy's
    generation raises on the leader before the sharded forward (a tokenizer error; at tp=1 any error), its TP peers
    are released from their follow (the engine's ``lead`` ends it) and an error marker is broadcast instead of the
    texts, so every rank raises the same error at once rather than waiting out ``parallel.timeout_s``; a failure
    inside the sharded forward at tp > 1 leaves the peers in it.
    """
    endpoint = None
    if cfg.proposer == "endpoint":
        from esopt_mp.prompt.proposers import EndpointProposer

        endpoint = EndpointProposer(cfg.url, cfg.model, cfg.key_env, cfg.max_new_tokens, cfg.temperature, cfg.timeout_s)
    sampling = dataclasses.replace(player.train_cfg.sampling, max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature, stop=())
    dims, engine = player.dims, player.engine

    def ask(prompts: list[str], step: int, batches: list[int]) -> list[str]:
        """Batch b's proposal for its prompt, all at once: one generation batch, or concurrent requests."""
        seeds = [stream_seed(player.run_seed, "skill", step, b) for b in batches]
        texts, mine = None, None
        try:
            if endpoint is not None and dims.rank == 0:
                with ThreadPoolExecutor(max_workers=min(8, len(prompts))) as pool:
                    texts = list(pool.map(lambda a: _ask(endpoint, *a, step), zip(prompts, seeds, batches)))
            elif endpoint is None and dims.dp_rank == 0:
                messages = [[{"role": "user", "content": p}] for p in prompts]
                texts = engine.lead(lambda: generate_texts(engine, messages, seeds, sampling), sampling)
        except Exception as e:  # on rank 0 the marker replaces the texts; any rank still joins the broadcast
            log.exception("skill proposal of step %d failed on rank %d", step, dims.rank)
            texts = mine = {"error": f"{type(e).__name__}: {e}", "rank": dims.rank}
        got = dims.comm.broadcast_object(texts, src=0, dim="world")
        failed = got if isinstance(got, dict) else mine
        if failed is not None:
            raise RuntimeError(f"prompt.skill.proposer={cfg.proposer}: the proposal of step {step} failed on "
                               f"rank {failed['rank']}: {failed['error']}")
        return got

    return {"proposer": Proposer(ask),
            "validate": lambda text, step, steps=(): validate_context(player, text, step, cfg.val_tasks, steps)}


def validate_context(player, text: str, step: int, n: int, steps=()) -> float:
    """Mean return of ``n`` training tasks that neither ``step`` nor ``steps`` played (every step whose trajectories
    the proposer read; fewer left: any), played with ``text`` as the context; seeds from (run seed, step), so two
    contexts validated at one step meet the same episodes. The episodes are spread over the dp groups and summed (one
    all-reduce), like held-out evaluation; a failed episode scores its environment's failure return, as there."""
    dims = player.dims
    played = {id(t) for s in {step, *steps} for t in player.step_tasks(s)}
    rest = [t for t in player.train_tasks if id(t) not in played]
    pool = rest if len(rest) >= n else player.train_tasks
    if pool is not rest:
        log.warning("step %d: only %d training tasks were not played by the steps the proposer read, fewer than "
                    "prompt.skill.val_tasks=%d: the held-out mini-batch is drawn from all %d (raise env.n_train)",
                    step, len(rest), n, len(player.train_tasks))
    rng = random.Random(stream_seed(player.run_seed, "skill_val", step))
    tasks = [pool[i] for i in rng.sample(range(len(pool)), min(n, len(pool)))]
    seeds = [stream_seed(player.run_seed, "skill_val", step, i + 1) for i in range(len(tasks))]
    mine = list(range(dims.dp_rank, len(tasks), dims.dp))
    total, count = 0.0, 0
    if mine:  # a skill that makes episodes fail must lose: failures score the env's failure return
        eps = player.play([tasks[i] for i in mine], [seeds[i] for i in mine], player.eval_cfg,
                          render=lambda s, slot: text, kind="skill_val", step=step, context=context_hash(text))
        total, count = return_total(eps, failed_count=True)
    stats = dims.comm.all_reduce(torch.tensor([total, count], dtype=torch.float64), "sum", "world")
    return stats[0].item() / stats[1].item() if stats[1].item() else math.nan


class Proposer:
    """``proposer(prompt, step, batch)`` for one batch, ``proposer.many(prompts, step)`` for all of a step's
    batches in one go (skill synthesis prefers it: one generation batch instead of one per batch)."""

    def __init__(self, ask):
        self.ask = ask

    def __call__(self, prompt: str, step: int, batch: int) -> str:
        return self.ask([prompt], step, [batch])[0]

    def many(self, prompts: list[str], step: int) -> list[str]:
        return self.ask(prompts, step, list(range(len(prompts))))


def _ask(endpoint, prompt: str, seed: int, batch: int, step: int) -> str:
    """An endpoint's proposal; a failed request becomes a proposal without edits (dropped with its reason)."""
    try:
        return endpoint(prompt, seed)
    except Exception as e:
        log.warning("prompt.skill.url: proposal of step %d batch %d failed: %s", step, batch, e)
        return f"(endpoint error: {type(e).__name__}: {e})"
