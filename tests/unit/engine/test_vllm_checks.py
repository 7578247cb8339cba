"""engine=vllm's refusals, checked without vLLM: each is one clear line, before any engine starts."""
import os

import pytest

from esopt_mp.config import ConfigError, build_config
from esopt_mp.engine.vllm import VLLMUnavailable, check_vllm_request, import_vllm

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def _vllm_imports() -> bool:
    try:
        import_vllm()
        return True
    except VLLMUnavailable:
        return False


def test_architecture_without_a_mapping_is_refused():
    with pytest.raises(ValueError, match=r"architecture \['Gemma3ForCausalLM'\] has no checked canonical mapping"):
        check_vllm_request({**QWEN3, "architectures": ["Gemma3ForCausalLM"]}, 1)


def test_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="parallel.tp=3 does not divide the model's num_attention_heads=4"):
        check_vllm_request(QWEN3, 3)
    q35 = {**QWEN3, "architectures": ["Qwen3_5ForCausalLM"], "num_attention_heads": 8, "linear_num_value_heads": 6}
    with pytest.raises(ValueError, match="linear_num_value_heads=6"):
        check_vllm_request(q35, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=2: one must divide the other"):
        check_vllm_request({**QWEN3, "num_attention_heads": 12}, 3)
    assert check_vllm_request(QWEN3, 4)["head_dim"] == 32  # kv heads replicated over tp=4 are fine


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU attention's head sizes")
def test_cpu_head_dim_is_checked_before_the_engine():
    with pytest.raises(ValueError, match="head_dim in .* the model has 16"):
        check_vllm_request({**QWEN3, "head_dim": 16}, 1)


def test_config_refuses_unknown_engines_and_vllm_baselines():
    with pytest.raises(ConfigError, match="engine.name: unknown engine 'sglang'; known: hf, vllm"):
        build_config({"engine": {"name": "sglang"}})
    with pytest.raises(ConfigError, match="engine=vllm serves ES rollouts; algo=grpo"):
        build_config({"engine": {"name": "vllm"}, "algo": {"name": "grpo"}})
    with pytest.raises(ConfigError, match="engine.weight_sync"):
        build_config({"engine": {"name": "vllm", "weight_sync": "sometimes"}})


@pytest.mark.skipif(_vllm_imports(), reason="vLLM imports here: the missing-vLLM path cannot be shown")
def test_engine_vllm_without_vllm_is_one_line(tmp_path):
    """launch/train.py runs preflight before anything is built and prints a RuntimeError as one line, exit 2 (that
    path, as a user meets it: tests/integration/test_launch.py)."""
    from esopt_mp.engine.vllm import preflight

    cfg = build_config({"engine": {"name": "vllm"}, "objective": {"name": "agent"},
                        "model": {"path": "builtin:tiny_agent"}, "run": {"dir": str(tmp_path)}})
    with pytest.raises(VLLMUnavailable) as e:
        preflight(cfg)
    assert isinstance(e.value, RuntimeError) and str(e.value).startswith("engine.name=vllm needs vLLM")
    assert "\n" not in str(e.value) and not os.listdir(tmp_path)
