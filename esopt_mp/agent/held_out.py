"""Held-out evaluation of an agent run: Mean@k and Pass@k of the unperturbed weights on the eval tasks.

Every eval task is played ``env.eval_repeats`` (k) times, spread over the dp groups, each sample seeded by (question,
sample) only: the same streams at every evaluation and across a resume (common random numbers: before and after are
comparable). All-reduces give every rank the Mean@k (mean return) and Pass@k (per question the best of k) that one
group playing all would get. A failed episode -- the model's error, its wall clock, or an infrastructure fault --
scores its environment's failure return (0; a design problem's failure score): a failure is not an answer.
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from esopt_mp.core.errors import FAILURE_KINDS
from esopt_mp.es.seeds import stream_seed


class HeldOut:
    def __init__(self, player, context=None):
        """``player``: the run's :class:`~esopt_mp.agent.episodes.EpisodePlayer`; ``context``: the run's context
        (``esopt_mp.prompt.run.PromptRun``), whose current text joins each system prompt, or None."""
        self.player, self.context = player, context
        self.round = 0  # evaluations this process ran: a trajectory tag only, never a seed (not checkpointed)

    def evaluate(self) -> tuple[float, dict]:
        """(Mean@k, details) on every rank; details: k, questions, Mean@k, Pass@k, the thresholded accuracy
        (``above_half``), the share of episodes with full marks (``full``: return >= 1, a win or a solved board where
        the environment also scores partial credit), the failed episodes and those by kind.

        Group g plays the episodes g, g + dp, ... of the question-major list. Two all-reduces: (sum, count, above
        half, full marks, failures by kind) and, per question, the best return.
        """
        p, dims = self.player, self.player.dims
        r, k, n = self.round, p.cfg.eval_repeats, len(p.eval_tasks)
        self.round += 1
        mine = list(range(dims.dp_rank, n * k, dims.dp))
        seeds = [stream_seed(p.run_seed, "eval", e // k, e % k) for e in mine]
        ctx = {} if self.context is None else {"render": self.context.render, "context": self.context.hash}
        eps = p.play([p.eval_tasks[e // k] for e in mine], seeds, p.eval_cfg, slots=mine, kind="eval", round=r,
                     **ctx)  # [] on TP peers
        kinds = Counter(ep.failure for ep in eps if ep.failure)
        rets = [(e // k, ep.floor if math.isnan(ep.ret) else ep.ret) for e, ep in zip(mine, eps)]
        best = torch.full((n,), -math.inf, dtype=torch.float64)
        for q, ret in rets:
            best[q] = max(best[q].item(), ret)
        stats = torch.tensor([sum(x for _, x in rets), len(rets), sum(x > 0.5 for _, x in rets),
                              sum(x >= 1.0 for _, x in rets),
                              *(kinds[f] for f in FAILURE_KINDS)], dtype=torch.float64)
        total, count, above, full, *kinds = dims.comm.all_reduce(stats, "sum", "world").tolist()
        best = dims.comm.all_reduce(best, "max", "world")
        played = best[best > -math.inf]
        mean = total / count if count else math.nan
        return mean, {"k": k, "questions": n, f"mean@{k}": mean,
                      f"pass@{k}": played.mean().item() if len(played) else math.nan,
                      "above_half": above / count if count else math.nan,  # thresholded accuracy (ANLS > 0.5)
                      "full": full / count if count else math.nan,  # a win or a solved board
                      "failed": int(sum(kinds)),  # episodes that scored 0 (or the failure return): failed
                      "failures": {f: int(c) for f, c in zip(FAILURE_KINDS, kinds)}}
