import math

import pytest
import torch

from esopt_mp.models import build_tiny_qwen35
from tests.distributed import workers
from esopt_mp.parallel.local_world import run_world

LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (dp, tp)
STEPS = 2  # the second step starts from weights the first moved: what differs between layouts then compounds


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_qwen35(str(tmp_path_factory.mktemp("model") / "tiny"), seed=3)


@pytest.fixture(scope="module")
def layout_results(tiny_model, tmp_path_factory):
    out = {}
    for dp, tp in LAYOUTS:
        d = tmp_path_factory.mktemp(f"dp{dp}tp{tp}")
        run_world(dp * tp, workers.layout_worker, dp, tp, tiny_model, str(d / "run"), str(d / "out.pt"), STEPS)
        out[(dp, tp)] = torch.load(d / "out.pt")
    return out


def test_tp_shards_the_model(layout_results):
    sharded = layout_results[(1, 2)]["sharded"]
    assert "model.layers.0.mlp.down_proj.weight" in sharded and "lm_head.weight" in sharded
    assert layout_results[(1, 1)]["sharded"] == []


def test_seed_only_reward_gives_bit_identical_weights_on_every_layout(layout_results):
    ref = layout_results[(1, 1)]["seed_hash"]
    for layout in LAYOUTS[1:]:
        got = layout_results[layout]["seed_hash"]
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"{layout}: {k}"
    assert layout_results[(1, 1)]["seed_hash_comm"] == 0


def test_model_output_reward_agrees_to_tp_rounding(layout_results, tiny_model):
    """A model-output reward is the same on every layout up to TP's reduction order in fp32, and the weights
    differ only by what those reward differences do to the update.

    dp alone changes no computation (each member's forward is the unsharded one): bit-identical returns and weights.
    tp splits every row-parallel reduction (down_proj over intermediate_size I, o_proj, out_proj) into per-rank
    partial sums added by an all-reduce: a reordered fp32 sum, whose round-to-nearest error grows as sqrt(I) u of
    the output's scale, once per layer and for the lm_head (u = 2^-24). Each target log-prob carries it, and R, the
    mean of n of them (all negative, so the scale is |R|), adds log2(n) u of its own fp32 sum:
    |R_tp - R| <= ((L + 1) sqrt(I) + log2(n)) u |R| (the runs show <= 3 u |R|).
    z-scoring divides those differences by the returns' spread, and the update is theta += (alpha / G) sum_i w_i
    sign_i eps_i with the same eps on every layout (the seed-only test): so the final weights differ from the
    unsharded run's by sum_t (alpha_t / G) sum_i (w_tp - w)_ti sign_i eps_i, computed here in float64 from the two
    ledgers, up to the update's own fp32 rounding, per element: per step and run u |theta| for the weight's
    rounding and (G + 1) u (alpha / G) sum_i |w_i| |eps_i| for the fp32 accumulation."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    from esopt_mp.es import local_noise
    from esopt_mp.es.shard import ShardInfo

    base = load_file(f"{tiny_model}/model.safetensors")
    cfg = json.load(open(f"{tiny_model}/config.json"))
    ref = layout_results[(1, 1)]
    assert any(not torch.equal(ref["target_logprob"][k], base[k]) for k in ref["target_logprob"]), \
        "ES did not move the weights"
    u = torch.finfo(torch.float32).eps / 2
    n = 4 * 8  # objective batch x target_len (workers._cfg, ObjectiveConfig)
    k_r = (cfg["num_hidden_layers"] + 1) * math.sqrt(cfg["intermediate_size"]) + math.log2(n)
    for layout in LAYOUTS[1:]:
        got = layout_results[layout]
        assert got["target_logprob_shards"] == ref["target_logprob_shards"]
        for a, b in zip(ref["target_logprob_ledger"], got["target_logprob_ledger"], strict=True):
            assert (a["seeds"], a["signs"], a["alpha"]) == (b["seeds"], b["signs"], b["alpha"])
            ra, rb = np.array(a["returns"]), np.array(b["returns"])
            if layout[1] == 1:
                assert np.array_equal(ra, rb) and a["weights"] == b["weights"], layout
            assert (np.abs(rb - ra) <= k_r * u * np.abs(ra)).all(), \
                f"{layout} step {a['step']}: |dR| / (u |R|) {(np.abs(rb - ra) / (u * np.abs(ra))).max():.1f}"
        for name in ref["target_logprob_shards"]:
            theta, theta_tp = ref["target_logprob"][name].double(), got["target_logprob"][name].double()
            if layout[1] == 1:
                assert torch.equal(theta, theta_tp), f"{layout}: {name}"
                continue
            explained, rounding, size = torch.zeros_like(theta), torch.zeros_like(theta), base[name].double().abs()
            for a, b in zip(ref["target_logprob_ledger"], got["target_logprob_ledger"]):
                eps = [local_noise(seed, ShardInfo.full(name, theta.shape)).double() for seed in a["seeds"]]
                c = a["alpha"] / len(eps)
                explained += c * sum((wb - wa) * sg * e for wa, wb, sg, e in zip(a["weights"], b["weights"],
                                                                                 a["signs"], eps))
                mags = [c * sum(abs(w) * e.abs() for w, e in zip(r["weights"], eps)) for r in (a, b)]
                size = size + torch.maximum(*mags)  # |theta_t| bound: the base plus every update so far
                rounding += 2 * u * size + (len(eps) + 1) * u * (mags[0] + mags[1])
            excess = ((theta_tp - theta - explained).abs() - rounding).max()
            assert excess <= 0, f"{layout}: {name} exceeds its rounding bound by {excess:.2e}"


def test_comm_bytes_do_not_depend_on_model_size(layout_results):
    # STEPS steps of one all-gather of G=8 x (return, flag) float64, checksum every step over dp
    r = layout_results[(2, 2)]
    b, by_op = r["seed_hash_comm"], r["seed_hash_comm_by_op"]
    claims = by_op.get("broadcast", [0, 0])[1]
    assert 0 < b - claims < STEPS * (8 * 2 * 8 * 3 * 2 + 64 * 8 * 2)
    # the member queue: rank 0, its group's TP leader, tells its one peer each member it claims (a pickled small
    # int, 5 bytes, after its 8-byte length), at most G + 1 claims a step; and the queue's epoch, once, to 3 ranks
    assert claims <= STEPS * (8 + 1) * (5 + 8) + 3 * (5 + 8)


@pytest.mark.parametrize("world", [4])  # dp=2 x tp=1 has no tp peers: its ranks are the drifted ones here
def test_corrupted_replica_is_named(tiny_model, tmp_path, world):
    """dp=2 x tp=world/2: the shard of one tp rank drifts; every rank raises, the drifted tp ranks name it."""
    run_world(world, workers.drift_worker, tiny_model, str(tmp_path / "run"), str(tmp_path / "msg"))
    for rank in range(world):
        msg = torch.load(tmp_path / f"msg.{rank}")
        if rank % (world // 2) == world // 2 - 1:  # the tp rank whose shard drifted, in both dp groups
            assert "model.layers.1.mlp.down_proj.weight" in msg and "1 tensor(s) differ" in msg
        else:  # its tp peers would otherwise walk on into the next collective and hang
            assert "another tp rank's shards differ" in msg


def test_gather_returns_from_leaders_only(tmp_path):
    run_world(4, workers.gather_worker, str(tmp_path / "g"))
    for rank in range(4):
        returns, nbytes = torch.load(tmp_path / f"g.{rank}")
        assert returns[:3] == [1.0, 11.0, 21.0] and math.isnan(returns[3]) and returns[4:] == [41.0, 51.0]
        assert nbytes == 2 * 3 * 6 * 2 * 8  # sent + received of a 96-byte slice among 4 ranks


def test_qwen3_loads_sharded_with_selection(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_qwen35(str(tmp_path / "qwen3"), seed=1, arch="qwen3")
    run_world(2, workers.qwen3_tp_worker, path, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt")
    ref = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        expected = ref(input_ids=torch.arange(1, 13).view(2, 6)).logits
    assert (out["logits"] - expected).abs().max() < 1e-5
    names = {n for n, _, _ in out["shards"]}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert not any("norm" in n for n in names)
    shard = {n: (o, s) for n, o, s in out["shards"]}["model.layers.1.mlp.down_proj.weight"]
    assert shard == ((0, 0), (64, 64))  # rank 0 holds the first half of the 128 input columns


@pytest.mark.parametrize("tight", [False, True], ids=["no_budget", "token_budget"])
def test_sudoku_batch_under_tp2_matches_tp1(tmp_path, tight):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.envs import make
    from esopt_mp.envs.sudoku import generate
    from esopt_mp.models.tiny import build_tiny_agent_base

    path = build_tiny_agent_base(str(tmp_path / "agent"))
    tasks = generate(16, 4, size=4, seed=5)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))

    def tp1(budget):
        cfg = AgentConfig(max_turns=4, sampling=SamplingParams(temperature=0, max_new_tokens=8),
                          max_episode_tokens=budget)
        return run_episodes(engine, [make("sudoku", max_turns=4) for _ in tasks], tasks, list(range(16)), cfg)

    # token_budget: the leader ends episodes and caps turns at different points; its peer must follow each
    free = tp1(0)
    budget = sorted(len(e.token_ids) for e in free)[8] * 3 // 4 if tight else 0
    run_world(2, workers.sudoku_tp_worker, path, str(tmp_path / "ids"), budget)
    r0, r1 = (torch.load(tmp_path / f"ids.{r}") for r in (0, 1))
    assert r0["ids"] == r1["ids"] and len(r0["ids"]) == 16
    assert r0["stats"] == r1["stats"]  # the peer joined every forward pass
    eps = tp1(budget)
    assert [e.token_ids for e in eps] == r0["ids"]
    if tight:
        assert {e.ended for e in eps} == {"token_budget"} and len(eps[0].turns) < len(free[0].turns)
        assert {len(x) for x in r0["ids"]} == {budget}  # the last turn was capped to exactly what was left
