"""Canonical names are the checkpoint's keys; placements that are not boxes are refused."""
import json
import shutil

import pytest
import torch

from esopt_mp.models import build_shards, build_tiny_qwen35, checkpoint_keys, checkpoint_names, export_hf, load_model
from esopt_mp.parallel import ParallelDims
from esopt_mp.parallel.local_world import free_port

DIMS = ParallelDims(1, 1, 1)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def vlm(request, tmp_path_factory):
    """A saved tiny Qwen3_5ForConditionalGeneration: text weights under model.language_model.*"""
    return build_tiny_qwen35(str(tmp_path_factory.mktemp("vlm") / "ckpt"), seed=4, arch="qwen3_5_vlm",
                             tie_word_embeddings=request.param)


def test_vlm_checkpoint_keys_differ_from_module_names(vlm):
    keys = set(checkpoint_keys(vlm))
    model = load_model(vlm, DIMS)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    module_names = [n for n, _ in model.named_parameters()]
    assert not any(n in keys for n in module_names if n.startswith("model."))  # transformers renamed them


def test_every_shard_name_is_a_checkpoint_key(vlm):
    keys = set(checkpoint_keys(vlm))
    model = load_model(vlm, DIMS)
    shards = build_shards(model)
    names = [s.info.name for s in shards]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert all(n in keys for n in names), [n for n in names if n not in keys]
    assert "model.language_model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) == (not model.config.tie_word_embeddings)
    # es.include / es.exclude select by the canonical name
    sel = build_shards(model, include=["model.language_model.layers.*"], exclude=["*norm*"])
    assert sel and all(s.info.name.startswith("model.language_model.layers.") and "norm" not in s.info.name
                       for s in sel)


def test_export_writes_the_checkpoint_keys_and_reloads(vlm, tmp_path):
    from transformers import AutoModelForCausalLM

    model = load_model(vlm, DIMS)
    out = export_hf(model, None, str(tmp_path / "ex"), DIMS)
    text_keys = {k for k in checkpoint_keys(vlm) if not k.startswith("model.visual.")}
    assert set(checkpoint_keys(out)) == text_keys
    again = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(1, 13).view(2, 6)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_unmapped_parameter_fails_naming_it(tmp_path):
    base = build_tiny_qwen35(str(tmp_path / "base"), seed=1, arch="qwen3")
    model = load_model(base, DIMS)
    partial = tmp_path / "partial"
    shutil.copytree(base, partial)
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in checkpoint_keys(base)
                                            if k != "model.norm.weight"}}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has no key in the checkpoint"):
        build_shards(model, names=checkpoint_names(model, str(partial)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint_names(model, str(tmp_path / "nowhere"))


def _one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_strided_and_partial_placements_are_refused():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _one_rank_group()
    try:
        def module(placement):
            m = torch.nn.Module()
            m.w = torch.nn.Parameter(DTensor.from_local(torch.ones(8, 4), mesh, [placement]), requires_grad=False)
            return m

        ok = build_shards(module(Shard(0)), names={"w": "layers.0.w"})
        assert ok[0].info.name == "layers.0.w" and ok[0].info.is_full
        for placement, label in ((_StridedShard(0, split_factor=2), "_StridedShard"), (Partial(), "Partial")):
            with pytest.raises(ValueError, match=rf"^w: placement {label}"):
                build_shards(module(placement), names={"w": "layers.0.w"})
            m = module(placement)  # es.exclude, as the error suggests, leaves such a tensor out
            m.v = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
            kept = build_shards(m, exclude=["layers.0.w"], names={"w": "layers.0.w", "v": "v"})
            assert [s.info.name for s in kept] == ["v"]
    finally:
        dist.destroy_process_group()
