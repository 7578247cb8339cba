"""Export, replay and resume on tied and untied tiny Qwen3 / Qwen3.5, at tp=1 and tp=2 (spawned gloo)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from esopt_mp.models import build_tiny_qwen35
from esopt_mp.parallel import ParallelDims
from esopt_mp.parallel.local_world import run_world
from tests.integration import export_workers as W

VARIANTS = {f"{arch}_{'tied' if tie else 'untied'}": (arch, tie)
            for arch in ("qwen3", "qwen3_5") for tie in (False, True)}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_qwen35(str(root / name), seed=2, arch=arch, tie_word_embeddings=tie)
            for name, (arch, tie) in VARIANTS.items()}


@pytest.fixture(scope="module")
def tp1(variants, tmp_path_factory):
    """Per variant: an uninterrupted run A, an interrupted + resumed run B, and a replay of A."""
    from esopt_mp.runner import run
    from esopt_mp.trainer import ESTrainer
    from esopt_mp.replay import replay

    root = tmp_path_factory.mktemp("tp1")
    out = {}
    for name, path in variants.items():
        run_a = str(root / name / "a")
        trainer = ESTrainer(W.run_cfg(path, run_a), ParallelDims(1, 1, 1))
        run(trainer)
        with torch.no_grad():
            logits = trainer.model(input_ids=W.IDS).logits
            gen = trainer.model.generate(W.IDS[:1], max_new_tokens=6, do_sample=False)
        trainer.close()
        b = W.train_interrupted_then_resumed(path, str(root / name / "b"), 1, ParallelDims(1, 1, 1))
        out[name] = {"a": run_a, "b": str(root / name / "b"), "logits": logits, "gen": gen, "resumed": b,
                     "replay": replay(run_a, str(root / name / "replayed"))}
    return out


@pytest.fixture(scope="module")
def tp2(variants, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    run_world(2, W.tp2_worker, variants, str(root))
    with open(root / "results.json") as f:
        return root, json.load(f)


def _weights(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _check_tied(r, tied):
    """Each tensor is one ES shard; perturbing a tied embedding perturbs lm_head by the same eps."""
    assert r["unique"] and r["moved"] and r["head_moved_by_eps"] and r["restored"]
    assert r["tied_object"] == r["head_is_emb_shard"] == tied and r["lm_head_shard"] != tied


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", VARIANTS)
def test_export_loads_and_generates_like_the_model_in_memory(name, variants, tp1):
    from transformers import AutoModelForCausalLM

    r = tp1[name]
    export = os.path.join(r["a"], "export")
    got, base = _weights(export), _weights(variants[name])
    assert got.keys() == base.keys()  # the checkpoint's keys; a tied lm_head is stored once, as save_pretrained does
    assert ("lm_head.weight" in got) == (not VARIANTS[name][1])
    assert any(not torch.equal(got[k], base[k]) for k in got), "ES did not move the weights"
    assert os.path.isfile(os.path.join(export, "generation_config.json"))
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.tie_word_embeddings == VARIANTS[name][1]
    with torch.no_grad():
        assert torch.equal(model(input_ids=W.IDS).logits, r["logits"])
        assert torch.equal(model.generate(W.IDS[:1], max_new_tokens=6, do_sample=False), r["gen"])


@pytest.mark.parametrize("name", VARIANTS)
def test_resume_and_replay_reproduce_the_export(name, tp1):
    r = tp1[name]
    tied = r["resumed"]["tied"]
    _check_tied(tied, VARIANTS[name][1])
    assert r["resumed"]["stopped"] == {"stopped_at": 1} and r["resumed"]["start"] == 1
    a = _weights(os.path.join(r["a"], "export"))
    assert _same(a, _weights(os.path.join(r["b"], "export")))
    assert _same(a, _weights(r["replay"]))


@pytest.mark.parametrize("name", VARIANTS)
def test_tp2_resume_export_and_replay_match_tp1(name, tp1, tp2):
    from transformers import AutoModelForCausalLM

    from esopt_mp.replay import replay

    root, results = tp2
    r = results[name]
    tied = r["tied"]
    _check_tied(tied, VARIANTS[name][1])
    assert r["stopped"] == {"stopped_at": 1} and r["start"] == 1
    export = root / name / "export"
    ref = _weights(os.path.join(tp1[name]["a"], "export"))
    assert _same(ref, _weights(export))  # seed-only reward: bit-identical weights at any layout
    assert _same(ref, _weights(replay(str(root / name), str(root / name / "replayed"))))
    model = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        logits = model(input_ids=W.IDS).logits
    assert torch.allclose(logits, torch.tensor(r["logits"]), atol=1e-5, rtol=0)  # the sharded model in memory
