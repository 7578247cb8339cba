"""The canonical mapping of fused / sharded / padded runtime tensors, without vLLM (tests/vllm runs it on vLLM)."""
import math

import pytest
import torch

from esopt_mp.engine.runtime_map import (MappingError, Piece, box_slices, decode_probe, describe, index_tensor,
                                         local_shards, select)
from esopt_mp.engine.vllm_worker import checkpoint_format
from esopt_mp.es.perturber import Perturber
from esopt_mp.es.shard import LocalShard, ShardInfo

SHAPES = {"q": (8, 4), "k": (4, 4), "v": (4, 4), "o": (4, 8), "embed": (10, 4), "A_log": (4,), "conv": (12, 1, 3)}


def _bases(keys):
    bases, b = {}, 1
    for k in keys:
        bases[k] = b
        b += math.prod(SHAPES[k])
    return bases


def _runtime(rank: int, tp: int = 2) -> dict[str, torch.Tensor]:
    """What a vLLM-like loader puts on ``rank``: fused qkv, column-sharded o, padded vocab, a 3-section conv."""
    bases = _bases(SHAPES)
    idx = {k: index_tensor(s, bases[k]) for k, s in SHAPES.items()}
    sl = lambda n: slice(rank * n // tp, (rank + 1) * n // tp)  # noqa: E731
    embed = torch.zeros(8, 4, dtype=torch.float64)  # 10 rows over 2 ranks -> 5 each + 3 padding rows
    embed[:5] = idx["embed"][sl(10)]
    conv = torch.cat([idx["conv"][a:b][sl(4)] for a, b in ((0, 4), (4, 8), (8, 12))])
    return {"qkv": torch.cat([idx["q"][sl(8)], idx["k"][sl(4)], idx["v"][sl(4)]]),
            "o": idx["o"][:, sl(8)].contiguous(), "embed": embed, "A_log": idx["A_log"][sl(4)].clone(), "conv": conv}


def test_decode_fused_sharded_padded_layouts():
    pieces = decode_probe(_runtime(1), SHAPES, _bases(SHAPES))
    got = {(p.param, p.start, p.stop, p.info.name, p.info.offset, p.info.local_shape) for p in pieces}
    assert got == {
        ("qkv", 0, 16, "q", (4, 0), (4, 4)), ("qkv", 16, 24, "k", (2, 0), (2, 4)), ("qkv", 24, 32, "v", (2, 0), (2, 4)),
        ("o", 0, 16, "o", (0, 4), (4, 4)),
        ("embed", 0, 20, "embed", (5, 0), (5, 4)),  # the 3 padding rows belong to no piece
        ("A_log", 0, 2, "A_log", (2,), (2,)),
        ("conv", 0, 6, "conv", (2, 0, 0), (2, 1, 3)), ("conv", 6, 12, "conv", (6, 0, 0), (2, 1, 3)),
        ("conv", 12, 18, "conv", (10, 0, 0), (2, 1, 3)),
    }
    assert "qkv[0:16] <- q[4:8, 0:4] of (8, 4)" in describe(pieces)
    assert [p.info.name for p in select(pieces, ["*"], ["conv", "A_*"])] == ["q", "k", "v", "o", "embed"]
    assert Piece.from_json(pieces[0].to_json()) == pieces[0]


def test_ranks_cover_every_element_once():
    cover = {k: torch.zeros(s) for k, s in SHAPES.items()}
    for r in range(2):
        for p in decode_probe(_runtime(r), SHAPES, _bases(SHAPES)):
            cover[p.info.name][box_slices(p.info)] += 1
    assert all(bool((c == 1).all()) for c in cover.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturb_and_update_on_runtime_pieces_equal_canonical(dtype):
    """The fused/sharded runtime form of the perturbed/updated canonical weights, bit for bit."""
    torch.manual_seed(0)
    canon = {k: torch.randn(s).to(dtype) for k, s in SHAPES.items()}
    seeds, signs, w = [11, 11, 12], [1, -1, 1], [0.5, -1.0, 2.0]
    for r in range(2):
        ref = Perturber([LocalShard(t.clone(), ShardInfo.full(k, t.shape)) for k, t in canon.items()],
                        restore="subtract")
        pieces = decode_probe(_runtime(r), SHAPES, _bases(SHAPES))
        rt = {n: torch.zeros(t.shape, dtype=dtype) for n, t in _runtime(r).items()}
        for p in pieces:
            rt[p.param].view(-1)[p.start : p.stop] = canon[p.info.name][box_slices(p.info)].reshape(-1)
        pert = Perturber(local_shards(pieces, rt), restore="subtract")
        ref_t = {s.info.name: s.tensor for s in ref.shards}
        for op in ("perturb", "update"):
            if op == "perturb":
                ref.perturb(5, 0.1, -1)
                pert.perturb(5, 0.1, -1)
            else:
                ref.update(seeds, signs, w, 0.01, 0.1)
                pert.update(seeds, signs, w, 0.01, 0.1)
            for p in pieces:
                want = ref_t[p.info.name][box_slices(p.info)].reshape(-1)
                assert torch.equal(rt[p.param].view(-1)[p.start : p.stop], want), (op, p)
            assert bool((rt["embed"][5:] == 0).all())  # padding rows never get noise
            if op == "perturb":
                ref.restore()
                pert.restore()
        # the checkpoint-format view (what a reload hands vLLM) puts each box back where it came from
        full = dict(checkpoint_format(pieces, rt, SHAPES))
        for p in pieces:
            assert torch.equal(full[p.info.name][box_slices(p.info)], ref_t[p.info.name][box_slices(p.info)])


def test_refuses_what_is_not_a_box_copy():
    bases = _bases(["o"])
    t = index_tensor((4, 8), 1)
    with pytest.raises(MappingError, match="transposed or transformed"):
        decode_probe({"o": t.t().contiguous()}, {"o": (4, 8)}, bases)
    with pytest.raises(MappingError, match="transformed"):
        decode_probe({"o": -t.exp()[:, :1].contiguous()}, {"o": (4, 8)}, bases)
    half = t.clone()
    half[0, 4:] = math.nan
    with pytest.raises(MappingError, match="partly loaded"):
        decode_probe({"o": half}, {"o": (4, 8)}, bases)
    with pytest.raises(MappingError, match="overlap"):
        decode_probe({"a": t.clone(), "b": t[1:3].clone()}, {"o": (4, 8)}, bases)
    with pytest.raises(MappingError, match="receives nothing"):
        decode_probe({"o": torch.full((2, 2), math.nan, dtype=torch.float64)}, {"o": (4, 8)}, bases)


def test_checkpoint_of_fused_pieces_loads_into_whole_tensors_and_back(tmp_path):
    """A rank whose runtime tensors hold several boxes of one canonical tensor (Qwen3.5's in_proj_qkv, conv1d in
    vLLM) saves them as DCP chunks of the canonical tensor; the checkpoint loads into the hf engine's whole tensors
    and back."""
    from esopt_mp.checkpoint import save_checkpoint
    from esopt_mp.resume import load_checkpoint_
    from esopt_mp.checkpoint_export import export_checkpoint
    from esopt_mp.parallel import ParallelDims

    dims = ParallelDims(1, 1, 1)
    torch.manual_seed(1)
    canon = {k: torch.randn(s) for k, s in SHAPES.items()}
    pieces = [p for r in range(2) for p in decode_probe(_runtime(r), SHAPES, _bases(SHAPES))]
    rts = [{n: torch.zeros(t.shape) for n, t in _runtime(r).items()} for r in range(2)]
    shards = []
    for r in range(2):  # both "ranks" in one Perturber: every box of every tensor, several per name
        for p in decode_probe(_runtime(r), SHAPES, _bases(SHAPES)):
            rts[r][p.param].view(-1)[p.start : p.stop] = canon[p.info.name][box_slices(p.info)].reshape(-1)
        shards += local_shards(decode_probe(_runtime(r), SHAPES, _bases(SHAPES)), {f"{n}": t for n, t in rts[r].items()})
    assert len(pieces) == len(shards)
    save_checkpoint(str(tmp_path), 1, Perturber(shards), dims)
    ck = str(tmp_path / "ckpt" / "step_000001")
    whole = Perturber([LocalShard(torch.zeros(s), ShardInfo.full(k, s)) for k, s in SHAPES.items()])
    load_checkpoint_(ck, whole, dims)
    assert all(torch.equal(s.tensor, canon[s.info.name]) for s in whole.shards)
    back = [{n: torch.zeros(t.shape) for n, t in _runtime(r).items()} for r in range(2)]
    again = Perturber([sh for r in range(2) for sh in local_shards(decode_probe(_runtime(r), SHAPES, _bases(SHAPES)),
                                                                   back[r])])
    load_checkpoint_(ck, again, dims)
    assert all(torch.equal(back[r][n], rts[r][n]) for r in range(2) for n in rts[r])
    # and export: the base directory's files and keys, each tensor assembled from its boxes
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    base.mkdir()
    save_file({k: torch.zeros(s) for k, s in SHAPES.items()}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    export_checkpoint(ck, str(base), str(tmp_path / "export"), torch.float32)
    out = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(out) == set(SHAPES) and all(torch.equal(out[k], canon[k]) for k in SHAPES)
    assert (tmp_path / "export" / "config.json").exists()


def test_a_loader_that_shifts_values_decodes_differently_under_the_two_encodings():
    """The worker probes twice (stride 1 and 3) and refuses a tensor whose pieces differ: a loader adding a
    constant (e.g. a norm stored as w + 1) would otherwise map every element one place off, silently."""
    shapes = {"norm": (64,)}
    plain = [decode_probe({"n": index_tensor((32,), 1, s)[:32].clone() + 0}, shapes, {"norm": 1}, s) for s in (1, 3)]
    assert plain[0] == plain[1]
    shifted = [decode_probe({"n": index_tensor((32,), 1, s) + 3}, shapes, {"norm": 1}, s) for s in (1, 3)]
    assert shifted[0] != shifted[1]  # offsets 3 vs 1: the worker raises MappingError naming the tensor
