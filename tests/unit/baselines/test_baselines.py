"""Baselines on the shipped tiny agent: real episodes' masks, the update machinery, config and launcher checks."""
import copy
import math
import os

import pytest
import torch

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.baselines import build_baseline, build_token_batch, synthetic_token_batch
from esopt_mp.baselines.config import AlgoConfig
from esopt_mp.config import ConfigError, TrainConfig, build_config
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.base import SamplingParams
from esopt_mp.envs import make
from esopt_mp.envs import sudoku
from esopt_mp.identity import config_hash
from esopt_mp.models import load_model
from esopt_mp.parallel import ParallelDims

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "esopt_mp", "assets", "tiny_agent")
DIMS = ParallelDims(1, 1, 1)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def _episodes(tokenizer, n=4, mask=3, turns=3):
    model = load_model(TINY, DIMS)
    engine = HFEngine(model, tokenizer)
    tasks = sudoku.generate(n, mask, size=4, seed=5)
    envs = [make("sudoku", max_turns=turns, hints=True, show_original=False) for _ in tasks]
    cfg = AgentConfig(turns, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, presence_penalty=0.0,
                                            max_new_tokens=10))
    return run_episodes(engine, envs, tasks, list(range(n)), cfg), engine


def test_loss_mask_is_exactly_the_assistant_tokens(tokenizer):
    eps, engine = _episodes(tokenizer)
    assert sum(len(e.turns) for e in eps) > len(eps)  # several multi-turn episodes
    batch = build_token_batch(eps, engine.pad_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r, ep in enumerate(eps):
        n = len(ep.token_ids)
        ids, mask = batch.input_ids[r, :n], batch.loss_mask[r, :n]
        assert not batch.loss_mask[r, n:].any() and not batch.attention_mask[r, n:].any()
        gen = ids[mask].tolist()
        # the masked tokens are the replies, turn by turn (the engine's eos <|im_end|> included) ...
        assert len(gen) == sum(t["response_tokens"] for t in ep.turns)
        assert tokenizer.decode([t for t in gen if t != im_end]) == "".join(t["response"] for t in ep.turns)
        # ... and everything else is what the model was shown: the prompts and environment messages
        assert tokenizer.decode(ids[~mask].tolist()) == "".join(t["prompt"] for t in ep.turns)
        assert batch.turn_end[r].sum() == len(ep.turns) and not (batch.turn_end[r, :n] & ~mask).any()


def test_failed_episodes_are_dropped(tokenizer):
    eps, engine = _episodes(tokenizer, n=2, turns=1)
    eps[0].ret = float("nan")
    batch = build_token_batch(eps, engine.pad_id)
    assert len(batch) == 1 and batch.rewards.tolist() == [eps[1].ret]


def _params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _recorded_update(name: str, micro: int, batch, model_dir: str = TINY) -> dict:
    """One update, recording each backward's gradient (``parts``), the accumulated gradient before clipping
    (``acc``; PPO's value head: ``head``), what AdamW steps on (``clipped``), the parameters after and the stats."""
    model = load_model(model_dir, DIMS)
    opt = build_baseline(name, model, AlgoConfig(name=name, lr=1e-3, micro_batch=micro, max_grad_norm=0.5), DIMS)
    rec: dict = {"parts": []}
    accumulate, step, adam = opt._accumulate, opt._step, opt.optimizer.step

    def on_accumulate():
        if any(p.grad is not None for p in opt.params):
            rec["parts"].append([p.grad.detach().float().clone() for p in opt.params])
        accumulate()

    def on_step():
        on_accumulate()
        rec["acc"] = [m.grad.clone() for m in opt.masters]
        rec["head"] = [q.grad.clone() for q in opt.value_head.parameters()] if opt.value_head is not None else []
        return step()

    def on_adam(*a, **k):
        rec["clipped"] = [m.grad.clone() for m in opt.masters]
        return adam(*a, **k)

    opt._accumulate, opt._step, opt.optimizer.step = on_accumulate, on_step, on_adam
    rec["stats"] = opt.update(batch)
    rec["params"] = [m.detach().clone() for m in opt.masters]
    return rec


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from esopt_mp.models.tiny import build_tiny_qwen35

    return build_tiny_qwen35(str(tmp_path_factory.mktemp("qwen3") / "m"), seed=5, arch="qwen3")


@pytest.mark.parametrize("name,arch", [("grpo", "qwen3_5"), ("grpo", "qwen3"), ("ppo", "qwen3")])
def test_micro_batching_accumulates_the_same_step(name, arch, tiny_qwen3):
    """Token-level mean over the minibatch: 1-row micro-batches accumulate the whole-batch gradient (fp32), and
    AdamW's step from it is the whole-batch step, each within the rounding its computation allows.

    Gradients, per tensor: the two runs sum the same per-token terms in different orders (one backward over 4 rows
    vs 4 backwards added up), and every layer of the backward chain rounds once more. Round-to-nearest errors of a
    reduction of n terms grow as sqrt(n) u sum|terms| (probabilistic bound, u = 2^-24), once per layer; the terms'
    scale is S = sum over the micro-batches of |their gradient|. So ||g_micro - g_full|| <= sqrt(n) (L + 1) u ||S||,
    n the minibatch's tokens, L the layers (about 15x what the runs show).

    Step, per element: AdamW's first step (bias-corrected, no weight decay) moves a weight by lr g / (|g| + eps).
    Near |g| ~ eps that divides a gradient difference by ~eps (a 1e-11 difference moves a weight by ~1e-6), so the
    bound is propagated from the recorded clipped gradients: lr |f(g1) - f(g2)| with f(g) = g / (|g| + eps), plus
    Adam's own few roundings (8 u of the update) and the weight's rounding (1 ulp).

    The bound assumes a row's own backward does not cancel much: S sums rows, not tokens. PPO's per-token advantages
    change sign along a row, and on Qwen3.5 the Gated-DeltaNet decay gates (dt_bias, A_log, in_proj_a: gradients
    through a cumulative product over the row) then cancel by about 2,000x (measured: 2,250 u S on one CPU, within
    the bound's 53 on another), which no a priori bound here covers. The accumulation is the same code for every
    architecture: PPO is checked on Qwen3's attention (2.2 u S of 53 measured), GRPO (one advantage per row) on
    both."""
    model_dir = TINY if arch == "qwen3_5" else tiny_qwen3
    batch = synthetic_token_batch(4, 2, 12, 6, 5, 512, 2, seed=3)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # both groups mixed: a nonzero advantage
    full, micro = _recorded_update(name, 0, batch, model_dir), _recorded_update(name, 1, batch, model_dir)
    assert len(full["parts"]) == 1 and len(micro["parts"]) == 4  # one backward vs one per row
    u = torch.finfo(torch.float32).eps / 2
    n, layers = int(batch.attention_mask.sum()), load_model(model_dir, DIMS).config.num_hidden_layers
    k = n ** 0.5 * (layers + 1)
    for i, (a, b) in enumerate(zip(full["acc"], micro["acc"])):
        scale = sum(part[i].abs() for part in micro["parts"])
        assert (a - b).norm() <= k * u * scale.norm(), (i, float((a - b).norm() / (u * scale.norm())))
    # the reported (pre-clip) norms differ by at most the gradients' difference (triangle inequality) plus the
    # rounding of each norm: fp32 squares summed pairwise (log2(N) u) per tensor, float64 across tensors
    g_full, g_micro = (torch.cat([g.reshape(-1) for g in r["acc"] + r["head"]]).double() for r in (full, micro))
    rounding = math.ceil(math.log2(g_full.numel())) * u * (g_full.norm() + g_micro.norm())
    assert abs(full["stats"]["grad_norm"] - micro["stats"]["grad_norm"]) <= (g_full - g_micro).norm() + rounding
    lr, eps = 1e-3, 1e-8
    f = lambda g: g.double() / (g.double().abs() + eps)  # noqa: E731
    for i, (g1, g2, p1, p2) in enumerate(zip(full["clipped"], micro["clipped"], full["params"], micro["params"])):
        ulp = torch.finfo(torch.float32).eps * torch.maximum(p1.abs(), p2.abs()).double()
        bound = lr * (f(g1) - f(g2)).abs() + lr * 8 * u * (f(g1).abs() + f(g2).abs()) + ulp
        assert ((p1 - p2).double().abs() <= bound).all(), (i, float(((p1 - p2).double().abs() - bound).max()))
    start = _params(load_model(TINY, DIMS))
    assert not torch.equal(torch.cat([p.reshape(-1) for p in full["params"]]), start)


def test_bf16_weights_keep_fp32_master_and_states():
    model = load_model(TINY, DIMS, "bfloat16")
    before = copy.deepcopy(model)
    opt = build_baseline("grpo", model, AlgoConfig(name="grpo", lr=1e-3, grad_checkpointing=True), DIMS)
    stats = opt.update(synthetic_token_batch(4, 2, 12, 6, 5, 512, 2, seed=1))
    assert stats["grad_norm"] > 0 and all(m.dtype == torch.float32 for m in opt.masters)
    assert all(w.dtype == torch.bfloat16 for w in opt.locals)
    states = [s for s in opt.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    # the weights are the bf16 rounding of the fp32 master
    assert all(torch.equal(w, m.bfloat16()) for w, m in zip(opt.locals, opt.masters))
    assert not torch.equal(_params(before), _params(model))
    assert opt.ref is not None and torch.equal(_params(opt.ref), _params(before))  # frozen reference
    # the checkpoint keeps the fp32 master (the bf16 weights are only its rounding)
    sd = opt.state_dict()
    assert list(sd["master"]) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(sd["master"][n], m) for n, m in zip(opt.names, opt.masters))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in sd["master"].values())
    fp32 = build_baseline("grpo", load_model(TINY, DIMS), AlgoConfig(name="grpo", beta=0.0), DIMS)
    assert "master" not in fp32.state_dict()  # fp32 weights are the master


def test_ppo_value_head_is_fp32_and_learns():
    model = load_model(TINY, DIMS, "bfloat16")
    opt = build_baseline("ppo", model, AlgoConfig(name="ppo", lr=1e-6, value_lr=1e-2, epochs=4), DIMS)
    assert opt.value_head.weight.dtype == torch.float32
    batch = synthetic_token_batch(4, 2, 12, 6, 5, 512, 2, seed=2)
    first = opt.update(batch)["value_loss"]
    for _ in range(5):
        last = opt.update(batch)["value_loss"]
    assert last < first


def test_algo_config_validation_and_hash():
    with pytest.raises(ConfigError, match=r"algo: unknown algorithm 'foo'; known: es, grpo, ppo"):
        build_config({"algo": {"name": "foo"}})
    with pytest.raises(ConfigError, match=r"algo\.generations"):
        build_config({"objective": {"name": "agent"}, "algo": {"name": "grpo", "generations": 1}})
    with pytest.raises(ConfigError, match=r"objective\.name"):
        build_config({"algo": {"name": "grpo"}})  # the default objective is target_logprob
    with pytest.raises(ConfigError, match=r"algo\.zero_stage"):
        build_config({"objective": {"name": "agent"}, "algo": {"name": "ppo", "zero_stage": 4}})
    for bad in ({"clip": 1.0}, {"clip": 0.0}, {"clip": float("nan")}, {"value_clip": 0.0}):
        with pytest.raises(ConfigError, match=rf"algo\.{next(iter(bad))}: must be"):
            build_config({"objective": {"name": "agent"}, "algo": {"name": "ppo", **bad}})
    with pytest.raises(ConfigError, match=r"algo\.tasks_per_step"):
        build_config({"objective": {"name": "agent"}, "parallel": {"dp": 8}, "algo": {"name": "grpo"}}, 8)
    a, b = TrainConfig(), TrainConfig()
    b.algo.lr = 2e-6
    assert config_hash(a) != config_hash(b)  # the weights depend on algo.*


def test_default_config_composes_with_each_algo():
    from tests.fixtures.configs import compose_config

    for name in ("es", "grpo", "ppo"):
        cfg = build_config(compose_config(f"algo={name}"))
        assert cfg.algo.name == name
    grpo = build_config(compose_config("algo=grpo")).algo
    assert (grpo.beta, grpo.clip, grpo.generations) == (1e-3, 0.2, 8)


def test_rollouts_sample_from_the_distribution_the_loss_scores():
    """top_p / top_k / min_p / presence penalty would make GRPO/PPO off-policy without an importance weight."""
    from esopt_mp.baseline_trainer import rollout_sampling
    from esopt_mp.baselines.config import AlgoConfig
    from esopt_mp.engine.config import EngineConfig

    p = rollout_sampling(EngineConfig(top_p=0.8, top_k=20, min_p=0.05, presence_penalty=1.5, max_new_tokens=33),
                         AlgoConfig(name="grpo", temperature=0.9))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.max_new_tokens) == (0.9, 1.0, 0, 0.0, 0.0, 33)
