"""The tp plan's override for models whose attention heads tp does not divide (esopt_mp.models.loading.attention_plan):
SmolLM2-135M's Llama layout (9 heads, 3 KV heads) and Gemma-3-270M's (4 heads, 1 KV head) get their attention
projections replicated at tp=2 instead of split inside a head; a model whose heads tp divides keeps transformers'
own plan. Configs only: no weights, no process group (the sharded runs: tests/distributed/test_real_model_tp.py)."""
import pytest

from esopt_mp.models.loading import attention_plan

REPLICATED = {f"model.layers.*.self_attn.{p}": "replicate" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def _config(tmp_path, arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

    small = dict(vocab_size=128, intermediate_size=128, num_hidden_layers=2)
    cfg = {"llama_9_3": lambda: LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=72, **small),
           "gemma3_4_1": lambda: Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                                        hidden_size=64, **small),
           "qwen3_4_2": lambda: Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                                            **small)}[arch]()
    path = tmp_path / arch
    cfg.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch, tp, plan", [
    ("llama_9_3", 2, REPLICATED),  # SmolLM2-135M's heads
    ("llama_9_3", 3, None),  # 3 heads and 1 KV head a rank: transformers' plan as it is
    ("gemma3_4_1", 2, REPLICATED),  # Gemma-3-270M's heads: one KV head cannot be split
    ("qwen3_4_2", 2, None),
    ("qwen3_4_2", 4, REPLICATED),
])
def test_attention_is_replicated_only_where_tp_does_not_divide_the_heads(tmp_path, arch, tp, plan):
    assert attention_plan(_config(tmp_path, arch), tp) == plan


def test_a_nested_text_model_whose_heads_tp_does_not_divide_is_one_line(tmp_path):
    from esopt_mp.models.tiny import tiny_qwen35_vlm_config

    tiny_qwen35_vlm_config().save_pretrained(tmp_path / "vlm")  # 4 heads, 2 KV heads
    assert attention_plan(str(tmp_path / "vlm"), 2) is None
    with pytest.raises(ValueError, match=r"^parallel.tp=4 does not divide the model's 4 attention heads / 2 KV heads "
                                         r"and esopt_mp replicates attention only in a plain causal LM: set "
                                         r"parallel.tp to a divisor of both$"):
        attention_plan(str(tmp_path / "vlm"), 4)
