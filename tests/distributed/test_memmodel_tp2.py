"""The memory model's shard bytes against a real tp=2 load (a world of two ranks)."""
import json

import pytest

from esopt_mp.models.tiny import build_tiny_qwen35, tiny_qwen35_config
from esopt_mp.profiling.memmodel import param_shards, predict
from tests.unit.profiling.test_memmodel import W


def shard_worker(rank: int, world: int, path: str, out: str) -> None:
    from esopt_mp.models import load_model
    from esopt_mp.parallel import discover, init_distributed

    dims = init_distributed(discover(), 1, 2)
    model = load_model(path, dims, dtype="bfloat16")
    local = {}
    for name, p in model.named_parameters():
        t = p.data.to_local() if hasattr(p.data, "to_local") else p.data
        local[name] = [list(t.shape), t.numel() * t.element_size()]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(local, f)


@pytest.mark.parametrize("tied", [True, False])
def test_shard_bytes_equal_a_real_tp2_load(tmp_path, tied):
    from esopt_mp.parallel.local_world import run_world

    # an odd vocabulary: the embedding / lm_head rows do not split evenly (rank 0 holds the larger chunk)
    kw = dict(vocab_size=515, tie_word_embeddings=tied)
    path = build_tiny_qwen35(str(tmp_path / "m"), **kw)
    run_world(2, shard_worker, path, str(tmp_path / "local"))
    ranks = [json.load(open(tmp_path / f"local.{r}")) for r in range(2)]
    shards = {s.name: s for s in param_shards(tiny_qwen35_config(**kw), tp=2)}
    assert set(shards) == set(ranks[0])
    for name, s in shards.items():
        assert list(s.local_shape) == ranks[0][name][0], name
    assert any(s.local_shape != s.global_shape for s in shards.values())
    pred = predict(tiny_qwen35_config(**kw), algo="inference", tp=2, **W)
    assert pred.device["weights"] == sum(b for _, b in ranks[0].values())
