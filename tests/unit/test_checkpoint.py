"""Checkpoint durability: manifests, fallback past a damaged newest checkpoint, pruning, identity refusals, and elastic
load across tp layouts (simulated shards, no process group; SIGKILL during a save is in
tests/integration/test_checkpoint_sigkill.py, the multi-writer saves under gloo and resumes across layouts in
tests/integration/test_resume.py)."""
import json
import os
import threading

import pytest
import torch

from esopt_mp import checkpoint as ck
from esopt_mp import resume
from esopt_mp.es import Perturber, member_seed
from esopt_mp.identity import config_identity
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.parallel import ParallelDims

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# name -> (global shape, dim split across tp; None: replicated)
SPEC = {"w": ((10, 12), 0), "v": ((6, 7), 1), "b": ((12,), None)}
DIMS = ParallelDims(1, 1, 1)


def full_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, (shape, _) in SPEC.items()}


def entries(n):
    return [{"step": s, "seeds": [member_seed(5, s, i) for i in range(4)], "signs": [1, -1, 1, -1],
             "weights": [0.5, -1.0, 0.25, 2.0], "alpha": 0.05} for s in range(n)]


def _bounds(n, tp, r):
    size = -(-n // tp)  # torch.chunk-style: ceil, the last part shorter
    return min(n, r * size), min(n, (r + 1) * size)


def perturber(state, tp=1, r=0, master="none"):
    shards = []
    for k, (shape, dim) in SPEC.items():
        off, loc, t = [0] * len(shape), list(shape), state[k]
        if dim is not None and tp > 1:
            a, b = _bounds(shape[dim], tp, r)
            off[dim], loc[dim] = a, b - a
            t = t.narrow(dim, a, b - a)
        shards.append(LocalShard(t.clone().contiguous(), ShardInfo(k, shape, tuple(off), tuple(loc))))
    return Perturber(shards, master=master)


def box(state, p):
    return {s.info.name: state[s.info.name][tuple(slice(o, o + n) for o, n in zip(s.info.offset, s.info.local_shape))]
            for s in p.shards}


DATA = "__0_0.distcp"  # the one writer's data file


def save_layout(run_dir, step, state, tp, keep=0, identity=None):
    """The chunks a tp-layout save writes (each distinct box once, as DCP dedups replicas), from one process."""
    final = os.path.join(run_dir, "ckpt", f"step_{step:06d}")
    os.makedirs(final + ".tmp", exist_ok=True)
    shards, seen = [], set()
    for r in range(tp):
        for s in perturber(state, tp, r).shards:
            if (s.info.name, s.info.offset) not in seen:
                seen.add((s.info.name, s.info.offset))
                shards.append(s)
    ck.write_shards(final + ".tmp", shards, [s.tensor for s in shards], None, 0)
    ck.finalize(final + ".tmp", final, step, {"dp": 1, "tp": tp}, 1, identity)
    ck.prune_checkpoints(run_dir, keep, step)
    return final


def states_at(n):
    """Reference weights after each of the first n ledger steps (replayed on one process)."""
    p = perturber(full_state())
    out = [{s.info.name: s.tensor.clone() for s in p.shards}]
    for e in entries(n):
        resume.replay_(p, [e])
        out.append({s.info.name: s.tensor.clone() for s in p.shards})
    return out


def _equal(p, want):
    return all(torch.equal(s.tensor, want[s.info.name]) for s in p.shards)


@pytest.mark.parametrize("save_tp,load_tp,master", [(1, 2, "none"), (2, 1, "none"), (2, 3, "none"),
                                                    (3, 2, "fp32_host"), (4, 4, "none")])
def test_elastic_load_assembles_each_box_from_any_layout(tmp_path, save_tp, load_tp, master):
    ref = full_state(1)
    path = save_layout(str(tmp_path), 3, ref, save_tp)
    for r in range(load_tp):
        p = perturber(full_state(2), load_tp, r, master)
        resume.load_checkpoint_(path, p)
        want = box(ref, p)
        assert _equal(p, want), (save_tp, load_tp, r)
        if master == "fp32_host":
            assert all(torch.equal(m, want[s.info.name]) for m, s in zip(p.state_tensors(), p.shards))


def test_load_refuses_missing_tensor_and_other_global_shape_before_writing(tmp_path):
    path = save_layout(str(tmp_path), 1, full_state(1), 2)
    p = perturber(full_state(2))
    p.shards.append(LocalShard(torch.zeros(3), ShardInfo.full("extra", (3,))))
    before = [s.tensor.clone() for s in p.shards]
    with pytest.raises(ck.CheckpointMismatch, match="no tensor extra"):
        resume.load_checkpoint_(path, p)
    assert all(torch.equal(a, s.tensor) for a, s in zip(before, p.shards))
    q = Perturber([LocalShard(torch.zeros(10, 13), ShardInfo.full("w", (10, 13)))])
    with pytest.raises(ck.CheckpointMismatch, match=r"global shape \(10, 12\)"):
        resume.load_checkpoint_(path, q)


def test_layout_that_cannot_map_is_refused_before_writing(tmp_path):
    """A checkpoint whose saved chunks do not cover this rank's box (a writer's chunks were lost from the
    metadata: here a tp=2 save of which only rank 0's half of w was recorded) names the tensor and the mesh, and
    is refused, not skipped: the checkpoint is intact, it is the layout that cannot map."""
    import torch.distributed.checkpoint as dcp

    st = full_state(1)
    final = os.path.join(tmp_path, "ckpt", "step_000001")
    os.makedirs(final + ".tmp")
    half = [s for s in perturber(st, 2, 0).shards if s.info.name == "w"] + perturber(st).shards[1:]
    real = dcp.default_planner._validate_global_plan  # DCP itself refuses to write an uncovered tensor
    dcp.default_planner._validate_global_plan = lambda plan, md: []
    try:
        ck.write_shards(final + ".tmp", half, [s.tensor for s in half], None, 0)
    finally:
        dcp.default_planner._validate_global_plan = real
    ck.finalize(final + ".tmp", final, 1, {"dp": 1, "tp": 2}, 1)
    p = perturber(full_state(2), 2, 1)
    before = [s.tensor.clone() for s in p.shards]
    with pytest.raises(ck.CheckpointMismatch, match=r"w cover 0 of the 60 elements .*cannot map onto the current mesh"
                                                    r".*move .* aside"):
        resume.load_checkpoint_(final, p)
    assert all(torch.equal(a, s.tensor) for a, s in zip(before, p.shards))
    with pytest.raises(ck.CheckpointMismatch):
        resume.restore_run_(str(tmp_path), p, DIMS, entries(1))


def test_checkpoint_of_another_configuration_is_refused_naming_the_difference(tmp_path):
    from esopt_mp.config import TrainConfig
    from esopt_mp.typed import from_dict

    mine = config_identity(TrainConfig())
    other = config_identity(from_dict(TrainConfig, {"es": {"population": 4, "sigma": {"start": 0.01}}}))
    path = save_layout(str(tmp_path), 1, full_state(1), 1, identity=other)
    p = perturber(full_state(2))
    before = [s.tensor.clone() for s in p.shards]
    with pytest.raises(ck.CheckpointMismatch, match=r"es.population 4 -> 8; es.sigma.start 0.01 -> "):
        resume.load_checkpoint_(path, p, identity=mine)
    with pytest.raises(ck.CheckpointMismatch):  # not skipped for an older one: it is another run's
        resume.restore_run_(str(tmp_path), p, DIMS, entries(1), identity=mine)
    assert all(torch.equal(a, s.tensor) for a, s in zip(before, p.shards))
    resume.load_checkpoint_(path, p, identity=other)
    assert _equal(p, box(full_state(1), p))


def test_format_1_checkpoint_is_skipped_for_the_ledger(tmp_path):
    ref = states_at(2)
    path = save_layout(str(tmp_path), 2, ref[2], 1)
    man = json.load(open(os.path.join(path, ck.MANIFEST)))
    json.dump(dict(man, format=1), open(os.path.join(path, ck.MANIFEST), "w"))
    assert ck.checkpoint_steps(str(tmp_path)) == []
    p = perturber(full_state())
    assert resume.restore_run_(str(tmp_path), p, DIMS, entries(2)) == 0 and _equal(p, ref[2])


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "missing_file", "tmp_only"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    ref = states_at(4)
    run = str(tmp_path)
    save_layout(run, 2, ref[2], 2)
    newest = save_layout(run, 4, ref[4], 2)
    f = os.path.join(newest, DATA)
    if damage == "truncate":
        os.truncate(f, os.path.getsize(f) - 100)
    elif damage == "flip":  # same size, valid header: only the SHA-256 sees it
        with open(f, "r+b") as fh:
            fh.seek(-5, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-5, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0xFF]))
    elif damage == "no_manifest":
        os.remove(os.path.join(newest, ck.MANIFEST))
    elif damage == "missing_file":
        os.remove(f)
    else:
        os.rename(newest, newest + ".tmp")
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 2
    assert _equal(p, ref[4])
    os.truncate(os.path.join(run, "ckpt", "step_000002", DATA), 50)  # both damaged: base + replay
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 0
    assert _equal(p, ref[4])


def test_prune_keeps_the_newest_and_removes_leftovers(tmp_path):
    run = str(tmp_path)
    st = full_state()
    for s in (2, 4):
        save_layout(run, s, st, 1, keep=2)
    os.makedirs(os.path.join(run, "ckpt", "step_000003.tmp"))  # an interrupted save
    save_layout(run, 9, st, 1, keep=0)  # a checkpoint from steps the ledger later lost
    save_layout(run, 6, st, 1, keep=2)
    assert sorted(os.listdir(os.path.join(run, "ckpt"))) == ["step_000004", "step_000006"]
    save_layout(run, 8, st, 1, keep=1)
    assert os.listdir(os.path.join(run, "ckpt")) == ["step_000008"]
    for s in (10, 12):
        save_layout(run, s, st, 1, keep=0)
    assert len(os.listdir(os.path.join(run, "ckpt"))) == 3


def test_save_checkpoint_single_rank_writes_manifest_and_prunes(tmp_path):
    ref = states_at(3)
    for s in (1, 2, 3):
        ck.save_checkpoint(str(tmp_path), s, perturber(ref[s]), DIMS, keep=2)
    assert [s for s, _ in ck.checkpoint_steps(str(tmp_path))] == [2, 3]
    man = ck.check_checkpoint(os.path.join(tmp_path, "ckpt", "step_000003"), digest=True)
    assert man["step"] == 3 and man["layout"] == {"dp": 1, "tp": 1} and set(man["files"]) == {DATA, ck.CHUNKS}
    assert not os.path.exists(os.path.join(tmp_path, "ckpt", "step_000003", ck.DCP_METADATA))  # no pickle kept
    p = perturber(full_state())
    assert resume.restore_run_(str(tmp_path), p, DIMS, entries(3)) == 3 and _equal(p, ref[3])


def test_resaving_a_step_replaces_it_and_leaves_no_leftover(tmp_path):
    ref = states_at(2)
    ck.save_checkpoint(str(tmp_path), 2, perturber(ref[1]), DIMS)  # e.g. from steps the ledger later lost
    ck.save_checkpoint(str(tmp_path), 2, perturber(ref[2]), DIMS)
    assert os.listdir(os.path.join(tmp_path, "ckpt")) == ["step_000002"]
    p = perturber(full_state())
    assert resume.restore_run_(str(tmp_path), p, DIMS, entries(2)) == 2 and _equal(p, ref[2])


def test_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    """The step after save() changes the weights before the write starts: the checkpoint holds the saved step."""
    ref = states_at(4)
    p = perturber(ref[2])
    gate, real = threading.Event(), ck.write_shards
    ck.write_shards = lambda *a: (gate.wait(30), real(*a))
    try:
        c = ck.Checkpointer(str(tmp_path), DIMS, keep=0, async_save=True)
        c.save(2, p)
        assert ck.checkpoint_steps(str(tmp_path)) == []  # not complete before wait()
        resume.replay_(p, entries(4)[2:])  # steps 3 and 4 run during the write
        gate.set()
        assert c.wait().endswith("step_000002")
        c.save(4, p)
        c.wait()
        c.close()
    finally:
        ck.write_shards = real
    assert [s for s, _ in ck.checkpoint_steps(str(tmp_path))] == [2, 4]
    for step in (2, 4):
        q = perturber(full_state(9))
        resume.load_checkpoint_(os.path.join(tmp_path, "ckpt", f"step_{step:06d}"), q)
        assert _equal(q, ref[step])


def test_failed_write_raises_and_leaves_no_checkpoint(tmp_path):
    c = ck.Checkpointer(str(tmp_path), DIMS, keep=0, async_save=True)
    real = ck.write_shards
    ck.write_shards = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        c.save(1, perturber(full_state()))
        with pytest.raises(ck.CheckpointError, match="step 1 was not written .*No space left"):
            c.wait()
    finally:
        ck.write_shards = real
        c.close()
    assert os.listdir(os.path.join(tmp_path, "ckpt")) == []


def _fail_dcp(monkeypatch, what: str):
    """Make DCP's own file I/O fail (it wraps the error in CheckpointException, a BaseException)."""
    import torch.distributed.checkpoint.filesystem as fs

    def boom(*a, **k):
        raise OSError(28 if what == "write" else 5, "No space left on device" if what == "write" else "I/O error")

    if what == "write":
        monkeypatch.setattr(fs, "_write_item", boom)
    else:
        monkeypatch.setattr(fs.FileSystemReader, "read_data", boom)


@pytest.mark.parametrize("async_save", [True, False])
def test_dcp_write_failure_becomes_checkpoint_error_and_leaves_nothing(tmp_path, monkeypatch, async_save):
    c = ck.Checkpointer(str(tmp_path), DIMS, keep=0, async_save=async_save)
    _fail_dcp(monkeypatch, "write")
    c.save(1, perturber(full_state()))
    with pytest.raises(ck.CheckpointError, match="step 1 was not written .*No space left"):
        c.wait()
    c.close()
    assert os.listdir(os.path.join(tmp_path, "ckpt")) == []


def test_dcp_read_failure_falls_back_and_says_when_it_cannot(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    ref, run = states_at(4), str(tmp_path)
    save_layout(run, 2, ref[2], 2)
    save_layout(run, 4, ref[4], 2)
    real, calls = fs.FileSystemReader.read_data, []

    def first_fails(self, plan, planner):  # the newest checkpoint's read fails once, midway
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "I/O error")
        return real(self, plan, planner)

    monkeypatch.setattr(fs.FileSystemReader, "read_data", first_fails)
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, entries(4)) == 2 and _equal(p, ref[4])
    _fail_dcp(monkeypatch, "read")
    with pytest.raises(ck.CheckpointError, match="reading failed .*no older checkpoint could replace .*rerun"):
        resume.restore_run_(run, perturber(full_state()), DIMS, entries(4))


def test_checkpoint_of_another_ledger_is_skipped(tmp_path):
    from esopt_mp.ledger import updates_digest

    ref, run = states_at(4), str(tmp_path)
    mine, other = entries(4), [dict(e, weights=[1.0, 1.0, 1.0, 1.0]) for e in entries(4)]
    for step, ents in ((2, mine), (4, other)):  # step 4 comes from a sibling run with the same config
        c = ck.Checkpointer(run, DIMS, async_save=False)
        c.save(step, perturber(ref[step]), updates_digest(ents[:step]).hexdigest()[:16])
        c.wait()
    p = perturber(full_state())
    assert resume.restore_run_(run, p, DIMS, mine) == 2 and _equal(p, ref[4])


def test_poll_finalizes_a_finished_background_write_at_the_next_step(tmp_path):
    c = ck.Checkpointer(str(tmp_path), DIMS, keep=0, async_save=True)
    gate, real = threading.Event(), ck.write_shards
    ck.write_shards = lambda *a: (gate.wait(30), real(*a))
    try:
        c.save(1, perturber(states_at(1)[1]))
        assert c.poll() is None and ck.checkpoint_steps(str(tmp_path)) == []  # still writing
        gate.set()
        c._pending[3].result(timeout=30)
        assert c.poll().endswith("step_000001") and [s for s, _ in ck.checkpoint_steps(str(tmp_path))] == [1]
        assert c.poll() is None  # nothing pending
    finally:
        ck.write_shards = real
        c.close()


def test_a_failed_finalize_is_one_error_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    """Rank 0's manifest write failing (disk full) ends the save with CheckpointError on every rank (here: one)."""
    c = ck.Checkpointer(str(tmp_path), DIMS, keep=0, async_save=False)

    real = ck._write_json

    def full(path, obj):
        if path.endswith(ck.MANIFEST):
            raise OSError(28, "No space left on device")
        real(path, obj)

    monkeypatch.setattr(ck, "_write_json", full)
    c.save(1, perturber(full_state()))
    with pytest.raises(ck.CheckpointError, match="step 1 was not written .*finalizing on rank 0: OSError"):
        c.wait()
    assert os.listdir(os.path.join(tmp_path, "ckpt")) == []


class _Planted:
    """A pickle that runs code when loaded: it creates the directory ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant(path, marker, manifest_too: bool = False, fmt: int | None = None):
    """Put a code-running ``.metadata`` pickle into checkpoint ``path``; ``manifest_too``: and list it in the manifest
    with its true size and SHA-256, as anyone who can write the run directory can."""
    import pickle

    from esopt_mp.identity import file_sha256

    meta = os.path.join(path, ck.DCP_METADATA)
    with open(meta, "wb") as f:
        pickle.dump(_Planted(marker), f)
    if manifest_too or fmt is not None:
        man = json.load(open(os.path.join(path, ck.MANIFEST)))
        man["files"][ck.DCP_METADATA] = {"bytes": os.path.getsize(meta), "sha256": file_sha256(meta)}
        if fmt is not None:
            man["format"] = fmt
        json.dump(man, open(os.path.join(path, ck.MANIFEST), "w"))


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
