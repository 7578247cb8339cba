"""Which rows of a turn are prefilled how: one left-padded re-encoding batch, or exact delta groups.

Padding is exact only for a conversation that starts from an empty cache: Qwen3.5's Gated
DeltaNet layers multiply padded positions' inputs by zero (``apply_mask_to_padding_states``),
and with no bias a zero input keeps a zero conv/recurrent state zero, so left padding before a
fresh sequence changes nothing (what ``model.generate`` relies on). Padding after a cached
prefix is not exact: the causal conv mixes the cached inputs into the pad positions and every
pad position applies the layer's decay, so the recurrent state would drift. A conversation
that continues from its cache therefore shares a forward only with conversations adding
exactly as many tokens (no padding at all; attention keys of different cached lengths are
left-padded and masked, which attention layers ignore exactly).

Each forward costs a fixed overhead plus its (padded) tokens; the plan moves the whole delta
groups into the re-encoding batch that minimise ``calls * call_tokens + padded tokens``. It depends on token counts only, so TP
peers given the same inputs plan the same forwards.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PrefillPlan:
    reencode: list[int]  # rows re-encoded from scratch as one left-padded batch
    groups: list[tuple[int, list[int]]]  # (new tokens, rows) continuing from their caches


def _fresh_cost(rows: list[int], lengths: list[int], call_tokens: int) -> int:
    return call_tokens + len(rows) * max(lengths[r] for r in rows) if rows else 0


def plan_prefill(lengths: list[int], cached: list[int], call_tokens: int) -> PrefillPlan:
    """Rows ``i`` hold ``lengths[i]`` tokens, ``cached[i]`` of them in their cache (0: no cache)."""
    if call_tokens < 0:
        raise ValueError(f"plan_prefill: call_tokens must be >= 0, got {call_tokens}")
    fresh = [i for i, c in enumerate(cached) if c == 0]
    by_new: dict[int, list[int]] = {}
    for i, (n, c) in enumerate(zip(lengths, cached)):
        if c:
            if not 0 < c < n:
                raise ValueError(f"row {i}: {c} cached tokens of {n}; nothing new to prefill")
            by_new.setdefault(n - c, []).append(i)
    groups = sorted(by_new.items())

    def cost(moved: list[int]) -> int:
        rows = fresh + [r for k in moved for r in groups[k][1]]
        rest = sum(call_tokens + n * len(g) for k, (n, g) in enumerate(groups) if k not in moved)
        return _fresh_cost(rows, lengths, call_tokens) + rest

    # The optimum re-encodes, for the batch width W it ends up with, exactly the groups that fit
    # under W and cost more on their own than W per row; so try every width a group or the
    # fresh rows can set (G^2 steps for G groups, G <= batch size).
    best = (cost([]), [])
    widths = [(max(lengths[r] for r in fresh), None)] if fresh else []
    widths += [(max(lengths[r] for r in g + fresh), k) for k, (_, g) in enumerate(groups)]
    for width, forced in widths:
        moved = [k for k, (n, g) in enumerate(groups) if k == forced or (
            max(lengths[r] for r in g) <= width and len(g) * width < call_tokens + n * len(g))]
        best = min(best, (cost(moved), moved))
    moved = best[1]
    return PrefillPlan(sorted(fresh + [r for k in moved for r in groups[k][1]]),
                       [grp for k, grp in enumerate(groups) if k not in moved])
