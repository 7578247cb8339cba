"""The ``engine`` section: which generation engine plays the episodes and its sampling settings. Plain Python.

The sampling defaults here are :class:`~esopt_mp.engine.base.SamplingParams`' too (it reads them from this
class), and both check them with :func:`check_sampling`.
"""
from __future__ import annotations

import dataclasses

from esopt_mp.typed import check, check_choice

ENGINES = ("hf", "vllm")
WEIGHT_SYNCS = ("auto", "inplace", "reload")


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float, max_new_tokens: int,
                   key: str = "engine") -> None:
    """The one check of sampling settings: the ``engine`` section's and every ``SamplingParams``' alike."""
    check(temperature >= 0, f"{key}.temperature", f"must be >= 0, got {temperature}")
    check(0 < top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {top_p}")
    check(top_k >= 0, f"{key}.top_k", f"must be >= 0 (0 = off), got {top_k}")
    check(0 <= min_p < 1, f"{key}.min_p", f"must be in [0, 1), got {min_p}")
    check(max_new_tokens >= 1, f"{key}.max_new_tokens", f"must be >= 1, got {max_new_tokens}")


@dataclasses.dataclass
class EngineConfig:
    name: str = "hf"  # hf | vllm
    prefix_reuse: bool = True  # hf: keep each conversation's KV between turns
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    min_p: float = 0.0
    presence_penalty: float = 1.5
    max_new_tokens: int = 64
    # vllm only (esopt_mp/engine/vllm.py)
    weight_sync: str = "auto"  # auto | inplace (GPU: edit vLLM's tensors) | reload (CPU: full reload_weights)
    enforce_eager: bool = True  # CUDA graphs off until tools/gpu_check.sh shows in-place edits reach them
    max_model_len: int = 0  # 0: the model's own context length
    gpu_memory_utilization: float = 0.85  # fraction of the device vLLM may take (weights + KV)
    kv_cache_gib: float = 0.0  # > 0: a fixed KV-cache budget instead (CPU default 1 GiB)

    def validate(self, key: str = "engine") -> None:
        check(self.name in ENGINES, f"{key}.name", f"unknown engine {self.name!r}; known: {', '.join(ENGINES)}")
        check_choice(self.weight_sync, WEIGHT_SYNCS, f"{key}.weight_sync")
        check(0 < self.gpu_memory_utilization <= 1, f"{key}.gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.kv_cache_gib >= 0, f"{key}.kv_cache_gib", f"must be >= 0, got {self.kv_cache_gib}")
        check(self.max_model_len == 0 or self.max_model_len > self.max_new_tokens, f"{key}.max_model_len",
              f"must be 0 (the model's) or exceed max_new_tokens={self.max_new_tokens}, got {self.max_model_len}")
        check_sampling(self.temperature, self.top_p, self.top_k, self.min_p, self.max_new_tokens, key)
