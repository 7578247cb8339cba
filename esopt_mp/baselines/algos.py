"""GRPO and PPO losses on multi-turn token batches (the update machinery is PolicyOptimizer's)."""
from __future__ import annotations

import torch

from esopt_mp.baselines.batch import TokenBatch
from esopt_mp.baselines.losses import (broadcast_turns, clipped_policy_loss, clipped_value_loss, gae_over_turns,
                                       group_advantages, k3_kl, whiten)
from esopt_mp.baselines.optimizer import PolicyOptimizer


class _ClippedPG(PolicyOptimizer):
    def _policy_terms(self, mb: TokenBatch, ctx: dict, logp: torch.Tensor, norm: dict):
        """Sum over this micro-batch's generated tokens of (clipped surrogate + beta k3), divided by the
        minibatch's token count, so that accumulated micro-batches give the minibatch's token mean."""
        mask, tokens = mb.loss_mask.float(), norm["tokens"]
        pg, clipped = clipped_policy_loss(logp, ctx["old_logp"], ctx["adv"], self.cfg.clip)
        loss = (pg * mask).sum()
        stats = {"pg_loss": float(loss.detach()) / tokens, "clipfrac": float((clipped.float() * mask).sum()) / tokens}
        if self.ref is not None:
            kl = k3_kl(logp, ctx["ref_logp"])
            kl_sum = (kl * mask).sum()
            loss = loss + self.cfg.beta * kl_sum
            stats["kl"] = float(kl_sum.detach()) / tokens
        return loss / tokens, stats

    def _old_and_ref(self, batch: TokenBatch, values: bool = False) -> dict:
        old, v = self._no_grad_pass(self.model, batch, values)
        ctx = {"old_logp": old}
        if self.ref is not None:
            ctx["ref_logp"], _ = self._no_grad_pass(self.ref, batch)
        if values:
            ctx["old_values"] = v
        return ctx


class GRPO(_ClippedPG):
    """Group-relative advantages ``(r - mean_g) / (std_g + eps)`` on every generated token of the episode."""

    def _prepare(self, batch: TokenBatch) -> dict:
        ctx = self._old_and_ref(batch)
        adv = group_advantages(batch.rewards, batch.group, self.cfg.adv_eps)
        ctx["adv"] = adv[:, None] * batch.loss_mask
        ctx["stats"] = {"adv_abs_mean": float(adv.abs().mean()) if len(adv) else 0.0}
        return ctx

    def _loss(self, mb: TokenBatch, ctx: dict, norm: dict):
        logp, _ = self.forward(self.model, mb)
        return self._policy_terms(mb, ctx, logp, norm)


class PPO(_ClippedPG):
    """Value head on the last hidden state; GAE over turns.

    V_k is read at ``turn_start`` (``s_k - 1``, the last token before turn ``k``'s reply, as verl
    does): the state the turn is generated from. Read after the reply it would be Q(s, a), and
    the advantage would shrink to 0 as the value head fits the reward.
    """

    value_head_size = 1

    def _prepare(self, batch: TokenBatch) -> dict:
        ctx = self._old_and_ref(batch, values=True)
        adv_t, ret_t = gae_over_turns(ctx["old_values"], batch.turn_start, batch.rewards, self.cfg.gamma, self.cfg.lam)
        adv = broadcast_turns(adv_t, batch.loss_mask, batch.turn_start)
        ctx["adv"] = whiten(adv, batch.loss_mask) if batch.loss_mask.sum() > 1 else adv
        ctx["returns"] = ret_t
        starts = batch.turn_start
        ctx["stats"] = {"value_mean": float(ctx["old_values"][starts].mean()) if starts.any() else 0.0,
                        "adv_abs_mean": float(adv_t[starts].abs().mean()) if starts.any() else 0.0}  # before whitening
        return ctx

    def _loss(self, mb: TokenBatch, ctx: dict, norm: dict):
        logp, values = self.forward(self.model, mb, values=True)
        loss, stats = self._policy_terms(mb, ctx, logp, norm)
        vl = clipped_value_loss(values, ctx["old_values"], ctx["returns"], self.cfg.value_clip)
        v_loss = (vl * mb.turn_start.float()).sum() / norm["turns"]  # mean over the minibatch's turns
        stats["value_loss"] = float(v_loss.detach())
        return loss + self.cfg.vf_coef * v_loss, stats
