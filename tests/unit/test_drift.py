"""esopt_mp.drift on a tiny random model (built in-process): identical models drift by nothing, a known perturbation
gives its own norm and moves the off-task NLL; the NLL is a masked, batch-invariant token mean."""
import json
import math
import os
import shutil

import pytest
import torch

from esopt_mp import drift as D
from esopt_mp.models.tiny import TOKENIZER_FILES, build_tiny_agent_base


@pytest.fixture(scope="module")
def start_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drift") / "start")
    return build_tiny_agent_base(path, seed=0, arch="qwen3", hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2)


@pytest.fixture(scope="module")
def tokenizer(start_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(start_dir)


def _perturbed(start_dir, out, scale=0.02, seed=1):
    """A copy of the start model with every parameter moved by scale * N(0, 1); returns (dir, ||perturbation||)."""
    model = D.load_fp32_model(start_dir)
    g = torch.Generator().manual_seed(seed)
    sq = 0.0
    with torch.no_grad():
        for _, p in model.named_parameters():
            d = torch.randn(p.shape, generator=g) * scale
            p.add_(d)
            sq += float((d.double() ** 2).sum())
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(start_dir, name), os.path.join(out, name))
    return out, math.sqrt(sq)


def test_the_shipped_texts_are_an_off_task_set():
    texts = D.offtask_texts()
    with open(os.path.join(os.path.dirname(D.__file__), "data", "offtask", "texts.json"), encoding="utf-8") as f:
        doc = json.load(f)
    assert "written for the esopt_mp project" in doc["note"] and doc["texts"] == texts
    assert len(texts) == 24 and len(set(texts)) == 24
    words = [len(t.split()) for t in texts]
    assert min(words) >= 40 and max(words) <= 120
    for t in texts:
        low = t.lower()
        assert not any(w in low for w in ("sudoku", "puzzle", "arithmetic", "equation", "solve")), t[:40]


def test_identical_models_drift_by_nothing(start_dir):
    got = D.drift(start_dir, start_dir)
    assert set(got) == {"offtask_nll_start", "offtask_nll_end", "offtask_nll_delta", "update_norm",
                        "relative_update_norm"}
    assert got["offtask_nll_delta"] == 0.0 and got["offtask_nll_start"] == got["offtask_nll_end"]
    assert got["update_norm"] == 0.0 and got["relative_update_norm"] == 0.0
    assert math.isfinite(got["offtask_nll_start"]) and got["offtask_nll_start"] > 0


def test_a_perturbed_model_has_its_norm_and_another_nll(start_dir, tmp_path):
    end, norm = _perturbed(start_dir, str(tmp_path / "end"))
    got = D.drift(start_dir, end)
    # the saved end weights are start + d rounded to fp32: off by half an ulp of |w| per element, far below 1e-5
    assert got["update_norm"] == pytest.approx(norm, rel=1e-5)
    _, base = D.update_norms(D.load_fp32_model(start_dir), D.load_fp32_model(start_dir))
    assert got["relative_update_norm"] == pytest.approx(norm / base, rel=1e-5)
    assert abs(got["offtask_nll_delta"]) > 1e-4
    assert got["offtask_nll_delta"] == pytest.approx(got["offtask_nll_end"] - got["offtask_nll_start"], abs=0)


def test_models_in_memory_need_a_tokenizer_and_match_the_directories(start_dir, tokenizer, tmp_path):
    end, _ = _perturbed(start_dir, str(tmp_path / "end"), seed=2)
    a, b = D.load_fp32_model(start_dir), D.load_fp32_model(end)
    with pytest.raises(ValueError, match="no tokenizer"):
        D.drift(a, b)
    assert D.drift(a, b, tokenizer=tokenizer) == D.drift(start_dir, end)


def test_offtask_nll_is_a_masked_token_mean_whatever_the_batching(start_dir, tokenizer):
    model = D.load_fp32_model(start_dir)
    texts = D.offtask_texts()[:5]
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) == 5  # uncut, so a batch pads all but one
    batched = D.offtask_nll(model, tokenizer, texts, max_tokens=4096, batch_size=5)
    assert batched == D.offtask_nll(model, tokenizer, texts, max_tokens=4096, batch_size=5)  # deterministic
    total = count = 0.0  # one text at a time, no padding: the token-weighted mean by hand
    for t in texts:
        ids = torch.tensor([tokenizer(t)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        total -= float(logp.gather(1, ids[0, 1:, None]).sum())
        count += ids.shape[1] - 1
    assert batched == pytest.approx(total / count, rel=1e-5)
    assert D.offtask_nll(model, tokenizer, texts, max_tokens=4096, batch_size=2) == pytest.approx(batched, rel=1e-5)
    cut = D.offtask_nll(model, tokenizer, texts, max_tokens=16, batch_size=5)  # the first 16 tokens of each
    assert cut != batched
    assert not model.training and all(not p.requires_grad for p in model.parameters())


def test_bad_inputs(start_dir, tokenizer, tmp_path):
    model = D.load_fp32_model(start_dir)
    with pytest.raises(ValueError, match="max_tokens"):
        D.offtask_nll(model, tokenizer, ["some text here"], max_tokens=1)
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        D.offtask_nll(model, tokenizer, ["a"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"texts": []}))
    with pytest.raises(ValueError, match="non-empty list"):
        D.offtask_texts(str(bad))
    with pytest.raises(FileNotFoundError):
        D.load_fp32_model(str(tmp_path / "missing"))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parameters differ"):
        D.update_norms(model, other)
