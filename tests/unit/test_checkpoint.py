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
from esopt_mp.es import Perturber
from esopt_mp.es.shard import LocalShard, ShardInfo
from esopt_mp.identity import config_identity
from tests.fixtures.checkpoints import DATA, DIMS, _equal, box, entries, full_state, perturber, save_layout, states_at

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
