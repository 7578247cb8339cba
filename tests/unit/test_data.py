"""Shipped task data: found without ../shared, overridable, and really inside an installed package."""
import hashlib
import os

import pytest

from esopt_mp.data import data_path, data_root, resolve
from esopt_mp.data.ahd_build import TEST_SHA256, build, generate

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PKG_DATA = os.path.join(ROOT, "esopt_mp", "data")


def test_shipped_splits_and_licence(monkeypatch):
    monkeypatch.delenv("ESOPT_DATA", raising=False)
    assert os.path.samefile(data_root(), PKG_DATA)
    counts = {rel: sum(1 for line in open(data_path(rel)) if line.strip())
              for rel in ("sudoku/train.jsonl", "sudoku/eval.jsonl", "math/dapo_evolve.jsonl",
                          "math/dapo_test.jsonl", "math/aime_2026.jsonl")}
    assert counts == {"sudoku/train.jsonl": 128, "sudoku/eval.jsonl": 128, "math/dapo_evolve.jsonl": 400,
                      "math/dapo_test.jsonl": 100, "math/aime_2026.jsonl": 30}
    assert "MIT License" in open(data_path("LICENSE-agentic-esopt")).read()
    assert "Zhi Zheng" in open(data_path("README.md")).read()


def test_resolve_rules(monkeypatch, tmp_path):
    monkeypatch.delenv("ESOPT_DATA", raising=False)
    assert resolve(None) is None and resolve("/abs/f.jsonl") == "/abs/f.jsonl" and resolve("f.jsonl") == "f.jsonl"
    assert resolve("data:sudoku/eval.jsonl") == data_path("sudoku/eval.jsonl")
    with pytest.raises(ValueError, match="inside the data root"):
        resolve("data:../../etc/passwd")
    with pytest.raises(FileNotFoundError, match="python -m esopt_mp.data.ahd_build"):
        data_path("ahd/datasets/tsp_constructive/test999_dataset.npy")
    (tmp_path / "sudoku").mkdir()
    (tmp_path / "sudoku" / "train.jsonl").write_text("")
    monkeypatch.setenv("ESOPT_DATA", str(tmp_path))
    assert resolve("data:sudoku/train.jsonl") == str(tmp_path / "sudoku" / "train.jsonl")
    with pytest.raises(FileNotFoundError, match=r"\$ESOPT_DATA="):
        resolve("data:sudoku/eval.jsonl")
    assert resolve("data:sudoku/eval.jsonl", must_exist=False) == str(tmp_path / "sudoku" / "eval.jsonl")


def test_ahd_build_reproduces_the_reference_stream(tmp_path):
    """The shipped train/val arrays are the start of the stream the unshipped test arrays continue."""
    files = generate()
    shipped = os.path.join(PKG_DATA, "ahd", "datasets", "tsp_constructive")
    for name in sorted(os.listdir(shipped)):
        with open(os.path.join(shipped, name), "rb") as f:
            assert files[name] == f.read(), name
    written = build(str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(TEST_SHA256)
    for p in written:
        with open(p, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == TEST_SHA256[os.path.basename(p)]


