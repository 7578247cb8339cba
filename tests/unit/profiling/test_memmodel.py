"""The memory model: exact parameter and shard bytes, monotone in what should shrink memory, checked on CPU."""

import pytest
import torch

from esopt_mp.models.presets import build_meta_model, qwen35_config
from esopt_mp.profiling.memmodel import param_shards, predict

W = dict(batch=4, context=512, new_tokens=64)


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("float32", 4)])
def test_weight_bytes_equal_the_meta_model_4b_tied(dtype, size):
    cfg = qwen35_config("4b")
    assert cfg.tie_word_embeddings
    model = build_meta_model("4b")
    exact = sum(p.numel() * size for p in model.parameters())  # a tied tensor counted once
    assert predict(cfg, algo="inference", dtype=dtype, **W).device["weights"] == exact
    assert {s.name: s.global_shape for s in param_shards(cfg)} == {n: tuple(p.shape) for n, p in
                                                                   model.named_parameters()}


def test_more_tp_fewer_weight_bytes():
    cfg = qwen35_config("9b")
    w = [predict(cfg, algo="es", tp=tp, **W).device["weights"] for tp in (1, 2, 4, 8)]
    assert w[0] > w[1] > w[2] > w[3]
    kv = [predict(cfg, algo="inference", tp=tp, **W).device["kv_cache"] for tp in (1, 2, 4)]
    assert kv[0] == 2 * kv[1] == 4 * kv[2]  # k/v projections are colwise: the cache splits by KV head
    rec = {predict(cfg, algo="inference", tp=tp, **W).device["recurrent_state"] for tp in (1, 2, 4)}
    assert len(rec) == 1  # Gated-DeltaNet projections gather their output: every rank runs the whole layer


def test_grad_checkpointing_fewer_activation_bytes():
    cfg = qwen35_config("4b")
    full, ckpt = (predict(cfg, algo="grpo", grad_checkpointing=g, **W).device["activations"] for g in (False, True))
    assert 0 < ckpt < full / 4


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_zero_stages_shrink_per_rank_memory(algo):
    cfg = qwen35_config("4b")
    tot = [predict(cfg, algo=algo, zero_stage=z, dp=4, **W).device_total for z in (0, 1, 2, 3)]
    assert tot[3] < tot[2] < tot[1] < tot[0]
    assert predict(cfg, algo=algo, zero_stage=3, dp=1, **W).device_total == tot[0]  # nothing to partition over
    if algo == "ppo":
        assert predict(cfg, algo="ppo", **W).device["value_head"] > 0


def test_es_modes_put_their_copies_on_the_host():
    cfg = qwen35_config("4b")
    n = sum(s.numel for s in param_shards(cfg))
    sub = predict(cfg, algo="es", **W)
    assert sub.host == {} and sub.device_total == predict(cfg, algo="inference", **W).device_total
    assert predict(cfg, algo="es", restore="snapshot", **W).host == {"snapshot": 2 * n}
    assert predict(cfg, algo="es", restore="snapshot", master="fp32_host", **W).host == {"fp32_master": 4 * n}
    chunk = lambda p: p.off_peak.get("es_chunk") or p.device["es_chunk"]  # noqa: E731
    assert chunk(sub) == chunk(predict(cfg, algo="es", restore="snapshot", master="fp32_host", **W))
    assert chunk(sub) == 4 * (1 << 24) + 40 * (1 << 17)  # one fp32 chunk + one noise block's temporaries


@pytest.mark.parametrize("key,value", [("algo", "dpo"), ("tp", 0), ("dtype", "int8"), ("zero_stage", 4),
                                       ("restore", "copy"), ("batch", 0), ("device", "tpu")])
def test_bad_input_names_the_argument(key, value):
    kw = dict(algo="es", **W)
    kw[key] = value
    with pytest.raises(ValueError, match=key):
        predict(qwen35_config("4b"), **kw)


def _tensor_bytes(obj, seen: dict) -> dict:
    """Bytes of every floating-point tensor reachable from ``obj`` (containers and object attributes), each storage
    once. Integer bookkeeping (a layer's length counter: one int64 scalar) is not state the model predicts."""
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensor_bytes(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_bytes(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.device, torch.dtype)):
        for v in vars(obj).values():
            _tensor_bytes(v, seen)
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cache_bytes_equal_the_caches_a_forward_allocates(dtype):
    """The rollout's cache terms against the tensors transformers' DynamicCache really holds: full-attention keys
    and values, Gated-DeltaNet conv and recurrent states, counted after a forward of ``batch`` x ``context`` and
    of ``batch`` x prompt tokens (the engine keeps each conversation's cache and stacks a decode copy of them).
    Measured resident-set growth beside the model is ``tools/memmodel.py --calibrate`` (its JSON)."""
    from esopt_mp.models.presets import _COMMON
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{**_COMMON, "vocab_size": 1024}, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=192, linear_num_value_heads=16,
                            layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()
    batch, context, new = 2, 40, 8

    def cache_bytes(tokens: int) -> dict[str, int]:
        with torch.no_grad():
            out = model(torch.randint(0, cfg.vocab_size, (batch, tokens)), use_cache=True)
        counted = {"kv_cache": 0, "recurrent_state": 0}
        for layer in out.past_key_values.layers:
            key = "recurrent_state" if type(layer).__name__.startswith("LinearAttention") else "kv_cache"
            counted[key] += sum(_tensor_bytes(layer, {}).values())
        return counted

    full, prompt = cache_bytes(context), cache_bytes(context - new)
    assert full["kv_cache"] > prompt["kv_cache"] > 0 and full["recurrent_state"] == prompt["recurrent_state"] > 0
    pred = predict(cfg, algo="inference", dtype=dtype, batch=batch, context=context, new_tokens=new)
    assert pred.device["kv_cache"] == full["kv_cache"] + prompt["kv_cache"]
    assert pred.device["recurrent_state"] == full["recurrent_state"] + prompt["recurrent_state"]
