"""Checkpoint metadata planted or tampered with on disk: never unpickled, refused with a reason, and skipped."""
import json
import os

import pytest
import torch

from esopt_mp import checkpoint as ck
from esopt_mp import resume
from tests.fixtures.checkpoints import (DIMS, _equal, _plant, entries, full_state, perturber, save_layout,
                                       states_at)


def test_a_planted_metadata_pickle_is_never_loaded(tmp_path):
    """A checkpoint's pickled DCP metadata replaced by one that runs code: resume, whole reads and export rebuild
    the metadata from chunks.json and never open the pickle; an older-format checkpoint that only has the pickle
    (the manifest rewritten to match it) is skipped for the ledger, not unpickled."""
    from safetensors.torch import load_file, save_file

    from esopt_mp.checkpoint_export import export_checkpoint, read_checkpoint

    ref, run = states_at(4), str(tmp_path / "run")
    marker = str(tmp_path / "code_ran")
    ck.save_checkpoint(run, 2, perturber(ref[2]), DIMS)
    path = os.path.join(run, "ckpt", "step_000002")
    assert not os.path.exists(os.path.join(path, ck.DCP_METADATA))  # the save keeps no pickle
    _plant(path, marker, manifest_too=True)
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 2 and _equal(p, ref[4])  # loaded, exact
    got = read_checkpoint(path)
    assert all(torch.equal(got[k], ref[2][k]) for k in ref[2])
    base = tmp_path / "base"
    base.mkdir()
    save_file({k: torch.zeros(v.shape) for k, v in ref[2].items()}, str(base / "model.safetensors"))
    export_checkpoint(path, str(base), str(tmp_path / "export"), torch.float32)
    out = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert all(torch.equal(out[k], ref[2][k]) for k in ref[2])
    os.remove(os.path.join(path, ck.CHUNKS))  # as a checkpoint of DCP's own format: only the pickle describes it
    _plant(path, marker, fmt=2)
    assert ck.checkpoint_steps(run) == []
    with pytest.raises(ck.CheckpointError, match=r"format 2 .*a pickled \.metadata is never read.*ledger replays"):
        resume.load_checkpoint_(path, perturber(full_state()))
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 0 and _equal(p, ref[4])
    assert not os.path.exists(marker)


@pytest.mark.parametrize("field,value,msg", [
    ("file", "../../outside.distcp", "must be a DCP data file name"),
    ("file", "/etc/passwd", "must be a DCP data file name"),
    ("offsets", [9, 0], "lies outside the tensor"),
    ("sizes", [10.5, 12], "non-negative integers"),
    ("offset", -1, "non-negative integers"),
    ("dtype", "object", "needs a dtype among"),
])
def test_a_tampered_chunk_description_is_refused_and_skipped(tmp_path, field, value, msg):
    """chunks.json rewritten (and the manifest with it, so the digests match): each malformed field is named, and
    the checkpoint is skipped for the previous one, never read outside its directory."""
    from esopt_mp.identity import file_sha256

    ref, run = states_at(4), str(tmp_path)
    save_layout(run, 2, ref[2], 1)
    path = save_layout(run, 4, ref[4], 2)
    desc = json.load(open(os.path.join(path, ck.CHUNKS)))
    t = desc["tensors"]["w"]
    if field == "dtype":
        t["dtype"] = value
    else:
        t["chunks"][0][field] = value
    json.dump(desc, open(os.path.join(path, ck.CHUNKS), "w"))
    man = json.load(open(os.path.join(path, ck.MANIFEST)))
    f = os.path.join(path, ck.CHUNKS)
    man["files"][ck.CHUNKS] = {"bytes": os.path.getsize(f), "sha256": file_sha256(f)}
    json.dump(man, open(os.path.join(path, ck.MANIFEST), "w"))
    with pytest.raises(ck.CheckpointError, match=msg):
        resume.load_checkpoint_(path, perturber(full_state()))
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 2 and _equal(p, ref[4])


def test_overlapping_chunks_are_refused():
    from esopt_mp.dcp_boxes import metadata_from_json

    chunk = {"offsets": [0, 0], "sizes": [2, 2], "file": "__0_0.distcp", "offset": 0, "length": 10}
    chunks = [chunk, dict(chunk, offsets=[1, 0])]
    desc = {"format": 1, "tensors": {"w": {"dtype": "float32", "size": [4, 2], "chunks": chunks}}}
    with pytest.raises(ValueError, match="chunk 1: overlaps another chunk"):
        metadata_from_json(desc, "x")
    desc["tensors"]["w"]["chunks"][1]["offsets"] = [2, 0]
    assert metadata_from_json(desc, "x").state_dict_metadata["w"].size == torch.Size([4, 2])


def test_a_description_with_more_chunks_than_any_layout_writes_is_refused_at_once():
    """A tampered chunks.json with 100,000 one-element chunks: refused by count, before the pairwise check (which
    would take hours on it)."""
    from esopt_mp.dcp_boxes import MAX_CHUNKS, metadata_from_json

    n = 100_000
    chunks = [{"offsets": [i], "sizes": [1], "file": "__0_0.distcp", "offset": 4 * i, "length": 4} for i in range(n)]
    desc = {"format": 1, "tensors": {"w": {"dtype": "float32", "size": [n], "chunks": chunks}}}
    with pytest.raises(ValueError, match=f"100000 chunks, more than any layout writes \\({MAX_CHUNKS}\\)"):
        metadata_from_json(desc, "x")
