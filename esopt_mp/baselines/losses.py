"""The numerics of agentic GRPO and PPO on multi-turn token masks (pure functions, tested by hand values).

TRL computes these inside its trainers (``GRPOTrainer._compute_loss``) over a
single completion per prompt; here a conversation holds several generated
spans separated by environment tokens, so the same formulas run on
``TokenBatch.loss_mask`` / ``turn_start`` instead of a completion mask.
"""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probability of ``input_ids[:, t]`` under ``logits[:, t - 1]`` (column 0: 0).

    One row at a time for half-precision logits (as TRL's ``selective_log_softmax``): the fp32
    log-softmax of a whole batch over a 248k vocabulary would dominate the step's memory.
    """
    target = input_ids[:, 1:]
    lg = logits[:, :-1]
    if lg.dtype in (torch.float32, torch.float64):
        out = lg.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(lg, -1)
    else:
        out = torch.stack([torch.log_softmax(r.float(), -1).gather(-1, t[:, None]).squeeze(-1)
                           for r, t in zip(lg, target)])
    return torch.nn.functional.pad(out.float(), (1, 0))


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: ``(r - mean_g) / (std_g + eps)`` within each group (population std; a one-member group gets 0)."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group.unique():
        m = group == g
        r = rewards[m].float()
        std = r.std(unbiased=False)
        adv[m] = (r - r.mean()) / (std + eps) if std > 0 else 0.0  # all equal: no signal (and no 0/0 at eps 0)
    return adv


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float):
    """Per-token PPO surrogate ``-min(rho A, clip(rho, 1-c, 1+c) A)`` and whether it clipped."""
    ratio = torch.exp(logp - old_logp)
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1`` with ``d = ref - logp`` (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float):
    """``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per element (PPO2's value clipping)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)


def gae_over_turns(values: torch.Tensor, turn_pos: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float):
    """GAE with one step per assistant turn; (advantage, return) ``[B, T]`` at the ``turn_pos`` positions.

    ``turn_pos`` marks where each turn's state value V_k is read (``TokenBatch.turn_start``:
    the state before the turn's reply). Turn ``k`` of an episode with ``K`` turns: reward 0
    except ``R`` after the last turn, ``delta_k = r_k + gamma V_{k+1} - V_k`` (``V_K = 0``:
    terminal), ``A_k = delta_k + gamma lam A_{k+1}``, return ``A_k + V_k``.
    """
    adv = torch.zeros_like(values, dtype=torch.float32)
    ret = torch.zeros_like(values, dtype=torch.float32)
    for b in range(values.shape[0]):
        pos = turn_pos[b].nonzero().squeeze(-1)
        v = values[b, pos].float()
        a_next, v_next = 0.0, 0.0
        for k in range(len(pos) - 1, -1, -1):
            r = float(rewards[b]) if k == len(pos) - 1 else 0.0
            a = r + gamma * v_next - v[k] + gamma * lam * a_next
            adv[b, pos[k]], ret[b, pos[k]] = a, a + v[k]
            a_next, v_next = a, v[k]
    return adv, ret


def broadcast_turns(per_turn: torch.Tensor, loss_mask: torch.Tensor, turn_start: torch.Tensor) -> torch.Tensor:
    """Copy each turn's value (stored at its ``turn_start`` position, ``s_k - 1``) onto the turn's generated tokens."""
    # turn index of generated position t = (number of turn starts strictly before t) - 1: turn k's start s_k - 1
    # precedes its tokens, and turn k+1's start (>= e_k - 1, its last token) is not strictly before any of them
    turn_id = torch.cumsum(turn_start.long(), 1) - turn_start.long() - 1
    out = torch.zeros_like(per_turn)
    for b in range(per_turn.shape[0]):
        vals = per_turn[b, turn_start[b]]
        if len(vals):
            ids = turn_id[b].clamp(min=0, max=len(vals) - 1)
            out[b] = torch.where(loss_mask[b], vals[ids], out[b])
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (token-level: every generated token weighs the same)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero-mean unit-variance over the masked entries (PPO's advantage normalisation)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask, (x - mean) / torch.sqrt(var + eps), torch.zeros_like(x))
