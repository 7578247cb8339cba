"""GRPO/PPO numerics against hand-computed values, and the token batch layout."""
import math

import pytest
import torch

from esopt_mp.baselines import synthetic_token_batch
from esopt_mp.baselines.batch import TokenBatch, _from_rows
from esopt_mp.baselines.losses import (broadcast_turns, clipped_policy_loss, clipped_value_loss, gae_over_turns,
                                       group_advantages, k3_kl, token_logprobs, whiten)


def test_clipped_policy_loss_by_hand():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))  # ratios (old logp = 0)
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    loss, clipped = clipped_policy_loss(logp, torch.zeros(4), adv, 0.2)
    # A>0: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5 ; A<0: min(-2.2, -2.2) = -2.2 ; min(-1.4, -1.6) = -1.6
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 2.2, 1.6]), atol=1e-6)
    assert clipped.tolist() == [True, False, False, True]


def test_k3_by_hand():
    logp, ref = torch.tensor([math.log(0.5), math.log(0.2)]), torch.tensor([math.log(0.25), math.log(0.2)])
    d = math.log(0.25 / 0.5)
    assert torch.allclose(k3_kl(logp, ref), torch.tensor([math.exp(d) - d - 1, 0.0]), atol=1e-7)
    assert float(k3_kl(logp, ref)[0]) == pytest.approx(0.5 - math.log(0.5) - 1)  # 0.19315
    assert bool((k3_kl(torch.randn(100), torch.randn(100)) >= 0).all())


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5]), torch.tensor([0, 0, 0, 0, 1, 1, 2]), 0.0)
    std = math.sqrt(0.25 * 0.75)  # population std of (1, 0, 0, 0)
    assert torch.allclose(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std, atol=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]  # all-equal group and singleton: no signal


def test_gae_over_turns_by_hand():
    # one episode, 3 turns ending at positions 2, 5, 7; values 0.2, 0.5, 0.6; reward 1 after the last turn
    values = torch.zeros(1, 9)
    turn_end = torch.zeros(1, 9, dtype=torch.bool)
    for p, v in ((2, 0.2), (5, 0.5), (7, 0.6)):
        values[0, p], turn_end[0, p] = v, True
    gamma, lam = 0.9, 0.8
    adv, ret = gae_over_turns(values, turn_end, torch.tensor([1.0]), gamma, lam)
    d2 = 1.0 - 0.6
    d1 = 0.0 + gamma * 0.6 - 0.5
    d0 = 0.0 + gamma * 0.5 - 0.2
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    assert torch.allclose(adv[0, [2, 5, 7]], torch.tensor([a0, a1, a2]), atol=1e-6)
    assert torch.allclose(ret[0, [2, 5, 7]], torch.tensor([a0 + 0.2, a1 + 0.5, a2 + 0.6]), atol=1e-6)
    assert adv[0, [0, 1, 3, 4, 6, 8]].abs().sum() == 0


def test_broadcast_turns_copies_each_turn_to_its_tokens():
    loss_mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    turn_start = torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)  # s_k - 1 of each turn
    per_turn = torch.zeros(1, 9)
    per_turn[0, 0], per_turn[0, 4] = 3.0, -1.0
    assert broadcast_turns(per_turn, loss_mask, turn_start).tolist() == [[0, 3, 3, 0, 0, -1, -1, -1, 0]]
    # back-to-back turns: turn 2 starts at turn 1's last token, which still belongs to turn 1
    adj = _from_rows([[1, 2, 3, 4, 5]], [[(1, 3), (3, 5)]], [1.0], [0], pad_id=0)
    assert adj.turn_start[0].nonzero().squeeze(-1).tolist() == [0, 2]
    derived = TokenBatch(adj.input_ids, adj.attention_mask, adj.loss_mask, adj.turn_end, adj.rewards, adj.group)
    assert torch.equal(derived.turn_start, adj.turn_start)
    per_turn = torch.tensor([[7.0, 0.0, 9.0, 0.0, 0.0]])
    assert broadcast_turns(per_turn, adj.loss_mask, adj.turn_start).tolist() == [[0, 7, 7, 9, 9]]


def test_clipped_value_loss_by_hand():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])
    # (1): unclipped (1-0)^2 = 1, clipped 0.7^2 = 0.49 -> 0.5 ; (2): (0-1)^2 = 1, clipped (0.3-1)^2 = 0.49 -> 0.5
    assert torch.allclose(clipped_value_loss(v, old, ret, 0.2), torch.tensor([0.5, 0.5]))
    v2 = torch.tensor([0.6])  # inside the clip range: both terms equal
    assert torch.allclose(clipped_value_loss(v2, torch.tensor([0.5]), torch.tensor([1.0]), 0.2), torch.tensor([0.08]))


def test_token_logprobs_match_log_softmax_in_both_precisions():
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    got = token_logprobs(logits, ids)
    assert got[:, 0].abs().sum() == 0 and torch.allclose(got[:, 1:], want, atol=1e-6)
    got16 = token_logprobs(logits.bfloat16(), ids)
    assert got16.dtype == torch.float32 and torch.allclose(got16[:, 1:], want, atol=0.05)


def test_whiten_ignores_unmasked_entries():
    x, mask = torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False])
    assert torch.allclose(whiten(x, mask), torch.tensor([-1.0, 1.0, 0.0]), atol=1e-4)


def test_synthetic_batch_layout():
    b = synthetic_token_batch(batch=4, turns=3, first_prompt=10, turn_prompt=5, new_tokens=4, vocab_size=50,
                              group_size=2, seed=1)
    assert b.input_ids.shape == (4, 10 + 3 * 4 + 2 * 5) and bool(b.attention_mask.all())
    assert b.loss_mask[0].nonzero().squeeze(-1).tolist() == [10, 11, 12, 13, 19, 20, 21, 22, 28, 29, 30, 31]
    assert b.turn_end[0].nonzero().squeeze(-1).tolist() == [13, 22, 31]
    assert b.turn_start[0].nonzero().squeeze(-1).tolist() == [9, 18, 27]  # the last prompt token before each reply
    # a TokenBatch built without turn_start (e.g. by the profiler) derives the same positions
    fields = {f: getattr(b, f) for f in ("input_ids", "attention_mask", "loss_mask", "turn_end", "rewards", "group")}
    assert torch.equal(TokenBatch(**fields).turn_start, b.turn_start)
    assert b.group.tolist() == [0, 0, 1, 1] and set(b.rewards.tolist()) <= {0.0, 1.0}


def test_right_padding_and_bad_spans():
    b = _from_rows([[1, 2, 3, 4], [5, 6]], [[(2, 4)], [(1, 2)]], [1.0, 0.0], [0, 0], pad_id=9)
    assert b.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 9, 9]] and b.attention_mask.tolist()[1] == [1, 1, 0, 0]
    assert b.loss_mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    sel = b.select([1])
    assert sel.input_ids.tolist() == [[5, 6]]  # trimmed to its own length
    with pytest.raises(ValueError, match="span"):
        _from_rows([[1, 2]], [[(0, 1)]], [1.0], [0], pad_id=0)  # a generated token needs a context
