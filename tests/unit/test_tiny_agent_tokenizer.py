"""The run-time tiny agent base copies the shipped tokenizer; the tool that builds the asset trains it. They
must be the same files, or a run with ``model.path: null`` and an agent objective would get another tokenizer
than the one the corpus and chat template describe."""
import os

from esopt_mp.models.tiny import TINY_AGENT, TOKENIZER_FILES
from tools.tiny_agent import build_tokenizer


def test_shipped_tokenizer_is_the_trained_one(tmp_path):
    build_tokenizer(str(tmp_path / "tok"))
    for name in TOKENIZER_FILES:
        with open(tmp_path / "tok" / name, "rb") as a, open(os.path.join(TINY_AGENT, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs: rebuild with python tools/build_tiny_agent.py"
