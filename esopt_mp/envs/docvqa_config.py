"""``env.docvqa``: the DocVQA environment's settings (a light module: the run config imports it)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile


@dataclasses.dataclass
class DocVQAConfig:
    """``env.docvqa``: the OCR tool, where generated documents go, and how much of a tool's output the agent sees."""

    tesseract: str = "tesseract"  # a name on PATH or an absolute path under a system directory the sandbox shows
    gen_dir: str | None = None  # synthetic documents (None: <tmp>/esopt_docvqa_synth)
    observation_chars: int = 4000  # of each tool output the agent sees its head and tail, the middle elided

    def validate(self, key: str = "env.docvqa") -> None:
        if self.observation_chars < 1:
            raise ValueError(f"{key}.observation_chars: must be >= 1, got {self.observation_chars}")
        resolve_tesseract(self.tesseract, key)

    def generated_dir(self) -> str:
        return self.gen_dir or os.path.join(tempfile.gettempdir(), "esopt_docvqa_synth")


def resolve_tesseract(path: str, key: str = "env.docvqa") -> str:
    """The real path of the tesseract binary; it must exist and lie where the sandbox can see it."""
    found = shutil.which(path)
    if not found:
        raise ValueError(f"{key}.tesseract: {path!r} not found; install it (apt-get install tesseract-ocr "
                         f"fonts-dejavu-core) or set {key}.tesseract to its path")
    from esopt_mp.envs.sandbox.interpreter import ro_paths

    real = os.path.realpath(found)
    if not any(real.startswith(p.rstrip("/") + "/") for p in ro_paths()):
        raise ValueError(f"{key}.tesseract: {real} is outside the directories the sandbox shows ({ro_paths()})")
    return real
