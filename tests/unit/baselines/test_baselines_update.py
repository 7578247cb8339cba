"""PolicyOptimizer.update edge cases and PPO's value placement (tiny agent, one process)."""
import os

import pytest
import torch

from esopt_mp.baselines import build_baseline, synthetic_token_batch
from esopt_mp.baselines.batch import _from_rows
from esopt_mp.baselines.config import AlgoConfig
from esopt_mp.models import load_model
from esopt_mp.parallel import ParallelDims

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")
DIMS = ParallelDims(1, 1, 1)


def _params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def test_ppo_reads_each_value_before_its_reply():
    """V_k is the value head at s_k - 1; with lam = 0 the return of turn k is r_k + V_{k+1}."""
    torch.manual_seed(0)
    batch = synthetic_token_batch(2, 3, 10, 5, 4, 512, 2, seed=7)
    batch.rewards = torch.tensor([1.0, 0.0])
    model = load_model(TINY, DIMS)
    opt = build_baseline("ppo", model, AlgoConfig(name="ppo", beta=0.0, gamma=1.0, lam=0.0), DIMS)
    torch.nn.init.normal_(opt.value_head.weight, std=0.5)  # distinct values at every position
    with torch.no_grad():
        ctx = opt._prepare(batch)
        h = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        v = opt.value_head(h).squeeze(-1)
    starts = [9, 18, 27]  # spans begin at 10, 19, 28
    assert batch.turn_start[0].nonzero().squeeze(-1).tolist() == starts
    assert ctx["returns"].ne(0).sum() <= 2 * len(starts) and not ctx["returns"][~batch.turn_start].any()
    for b in range(2):
        want = [float(v[b, starts[1]]), float(v[b, starts[2]]), float(batch.rewards[b])]
        assert ctx["returns"][b, starts].tolist() == pytest.approx(want, abs=1e-5)
        assert ctx["old_values"][b, starts].tolist() == pytest.approx(v[b, starts].tolist(), abs=1e-5)


def test_ppo_advantage_survives_a_fitted_value_head():
    """Reward is a function of the reply alone (same prompt): V(s) can only learn the mean, so |A| stays 0.5.

    A value read after the reply (the last generated token) fits the reward itself: measured |A| 0.0018
    after the same fit (values 0.997 / 0.0005), against 0.5 here (values 0.494).
    """
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    rows = [prompt + [21, 22, 23, 24], prompt + [31, 32, 33, 34]] * 2
    batch = _from_rows(rows, [[(8, 12)]] * 4, [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0], pad_id=0)
    model = load_model(TINY, DIMS)
    cfg = AlgoConfig(name="ppo", lr=1e-9, value_lr=1e-2, epochs=10, beta=0.0, vf_coef=1.0, value_clip=10.0)
    opt = build_baseline("ppo", model, cfg, DIMS)
    for _ in range(8):
        stats = opt.update(batch)
    with torch.no_grad():
        ctx = opt._prepare(batch)
    assert ctx["stats"]["value_mean"] == pytest.approx(0.5, abs=0.1)  # the value head has fitted E[R | s]
    assert ctx["stats"]["adv_abs_mean"] > 0.4 and stats["adv_abs_mean"] > 0.4
    adv = ctx["adv"][batch.loss_mask].reshape(4, 4)
    assert bool((adv[[0, 2]] > 0).all()) and bool((adv[[1, 3]] < 0).all())  # the rewarded reply is reinforced


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_empty_batch_takes_no_step(name):
    """All episodes failed: stats come back, the weights and the optimizer state are untouched."""
    model = load_model(TINY, DIMS)
    before = _params(model)
    opt = build_baseline(name, model, AlgoConfig(name=name, lr=1e-3), DIMS)
    stats = opt.update(_from_rows([], [], [], [], pad_id=0))
    assert stats["episodes"] == 0 and torch.equal(_params(model), before) and not opt.optimizer.state
    stats = opt.update(synthetic_token_batch(2, 1, 6, 0, 3, 512, 2, seed=0))  # and the next step still works
    assert stats["episodes"] == 2 and "grad_norm" in stats


def test_bf16_micro_batches_accumulate_in_fp32():
    """The master's grad is the fp32 sum of each micro-batch's bf16 gradient, not a sum rounded to bf16."""
    batch = synthetic_token_batch(8, 2, 12, 6, 5, 512, 2, seed=3)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    model = load_model(TINY, DIMS, "bfloat16")
    opt = build_baseline("grpo", model, AlgoConfig(name="grpo", lr=1e-3, micro_batch=1, max_grad_norm=0.0), DIMS)
    parts = {id(p): [] for p in opt.params}  # each backward's own gradient, before any accumulation
    for p in opt.params:
        p.register_hook(lambda g, k=id(p): parts[k].append(g.detach().clone()))
    seen = []
    step = opt.optimizer.step
    opt.optimizer.step = lambda: (seen.append([m.grad.clone() for m in opt.masters]), step())[1]
    opt.update(batch)
    fp32_err, bf16_err = 0.0, 0.0
    for p, got in zip(opt.params, seen[0]):
        assert len(parts[id(p)]) == 8 and got.dtype == torch.float32
        want = torch.stack([g.float() for g in parts[id(p)]]).sum(0)
        bf16 = parts[id(p)][0].clone()
        for g in parts[id(p)][1:]:
            bf16 += g  # what accumulating in bf16 p.grad gives
        scale = want.abs().max().clamp(min=1e-30)
        fp32_err = max(fp32_err, float((got - want).abs().max() / scale))
        bf16_err = max(bf16_err, float((bf16.float() - want).abs().max() / scale))
    assert fp32_err < 1e-5 < bf16_err / 10, (fp32_err, bf16_err)  # measured: 0.0 vs 0.018 (bf16 p.grad)
