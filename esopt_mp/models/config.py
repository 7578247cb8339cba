"""The ``model`` section: which checkpoint (or the tiny model built into run.dir) and its dtype. Plain Python."""
from __future__ import annotations

import dataclasses

from esopt_mp.typed import check, check_choice

DTYPES = ("float32", "bfloat16", "float16")
TINY_ARCHS = ("qwen3_5", "qwen3")


@dataclasses.dataclass
class TinyModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 4
    intermediate_size: int = 128
    seed: int = 0
    tie_word_embeddings: bool = False  # Qwen3.5-4B is tied, 9B/27B are not: test both
    arch: str = "qwen3_5"  # qwen3_5 | qwen3
    head_dim: int = 16  # vLLM's CPU attention needs a multiple of 32

    def validate(self, key: str) -> None:
        check_choice(self.arch, TINY_ARCHS, f"{key}.arch")
        check(self.head_dim > 0 and self.head_dim % 2 == 0, f"{key}.head_dim",
              f"must be even and > 0, got {self.head_dim}")


@dataclasses.dataclass
class ModelConfig:
    path: str | None = None  # local HF directory, a .gguf file, pypi:NAME; None builds the tiny model into run.dir
    dtype: str = "float32"
    tiny: TinyModelConfig = dataclasses.field(default_factory=TinyModelConfig)

    def validate(self, key: str = "model") -> None:
        check(self.path is None or self.path.strip() != "", f"{key}.path",
              "is empty (an unset variable?): a model directory, a .gguf file, pypi:NAME, builtin:NAME, or null "
              "for the tiny model")
        check_choice(self.dtype, DTYPES, f"{key}.dtype")
        self.tiny.validate(f"{key}.tiny")
