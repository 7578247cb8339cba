"""On CUDA with NCCL: the dp x tp invariance check, the TP channel and every collective on the rank's GPU."""

import pytest
import torch

from esopt_mp.parallel.local_world import run_world
from tests.distributed import collective_workers, workers

pytestmark = [pytest.mark.process, pytest.mark.slow]  # they start processes (gpu: the folder's)
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2 = pytest.mark.skipif(NGPU < 2, reason=f"dp x tp over NCCL needs >= 2 GPUs, found {NGPU}")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from esopt_mp.models import build_tiny_qwen35

    return build_tiny_qwen35(str(tmp_path_factory.mktemp("model") / "tiny"), seed=3)


def _layout(tmp, model, dp, tp):
    d = tmp / f"dp{dp}tp{tp}"
    run_world(dp * tp, workers.layout_worker, dp, tp, model, str(d / "run"), str(d / "out.pt"), 3, timeout=900)
    return torch.load(d / "out.pt", map_location="cpu", weights_only=False)


@needs_2
def test_dp_tp_invariance_on_nccl(tiny_model, tmp_path):
    layouts = [(1, 1), (2, 1), (1, 2)] + ([(2, 2)] if NGPU >= 4 else [])
    res = {lay: _layout(tmp_path, tiny_model, *lay) for lay in layouts}
    ref = res[(1, 1)]
    for lay in layouts[1:]:
        got = res[lay]
        assert got["seed_hash_comm"] > 0  # the returns all-gather, checksums and stop flags ran over NCCL
        for k in ref["seed_hash"]:
            assert torch.equal(got["seed_hash"][k].cpu(), ref["seed_hash"][k].cpu()), f"{lay}: {k}"
        for k in ref["target_logprob"]:
            a, b = got["target_logprob"][k].cpu(), ref["target_logprob"][k].cpu()
            assert (a - b).norm() / b.norm().clamp_min(1e-12) <= 1e-5, f"{lay}: {k}"


@needs_2
def test_agent_tp_channel_on_nccl(tmp_path):
    run_world(2, collective_workers.recorded_run_worker, 1, 2, str(tmp_path / "run"), str(tmp_path / "out"),
              timeout=900)
    for rank in (0, 1):
        out = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        assert out["comm_device"] == f"cuda:{rank}" and out["summary"] == {"stopped_at": 1}
        for name, devices, immediate, _ in out["records"]:
            assert devices == [] or devices == [out["comm_device"]], (name, devices, immediate)
        assert {"broadcast", "all_reduce"} <= {n for n, *_ in out["records"]}


def test_world1_on_cuda_checksum_and_step(tmp_path, tiny_model):
    """One GPU: a step on CUDA shards, and the checksum of a CUDA tensor equals its host copy's."""
    from esopt_mp.parallel import LaunchEnv, init_distributed, shard_checksum
    from esopt_mp.trainer import ESTrainer

    dims = init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1)
    assert dims.device_type == "cuda"
    trainer = ESTrainer(workers._cfg(1, 1, tiny_model, str(tmp_path / "run"), "target_logprob", 2), dims)
    before = {s.info.name: s.tensor.clone() for s in trainer.shards}
    trainer.step(0)
    assert all(s.tensor.is_cuda for s in trainer.shards)
    assert any(not torch.equal(before[s.info.name], s.tensor) for s in trainer.shards)
    for s in trainer.shards[:4]:
        assert shard_checksum(s.tensor) == shard_checksum(s.tensor.cpu())
    assert trainer.perturber.snapshot_host.pinned
