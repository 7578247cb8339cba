"""es.noise=lowrank is layout-invariant: the same weights bit for bit at dp x tp = 1x1, 1x2 and 2x2 (a return that
depends only on the member's seed, so any difference is the noise's or the update's), column- and row-parallel
shards regenerating exactly their rows of A and B."""
import torch

from esopt_mp.models import build_tiny_qwen35
from esopt_mp.parallel.local_world import run_world
from tests.distributed import workers

LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (dp, tp)


def test_lowrank_weights_are_bit_identical_on_every_layout(tmp_path):
    model = build_tiny_qwen35(str(tmp_path / "tiny"), seed=3)
    out = {}
    for dp, tp in LAYOUTS:
        d = tmp_path / f"dp{dp}tp{tp}"
        run_world(dp * tp, workers.lowrank_layout_worker, dp, tp, model, str(d / "run"), str(d / "out.pt"), 2)
        out[(dp, tp)] = torch.load(d / "out.pt")
    assert "model.layers.0.mlp.down_proj.weight" in out[(1, 2)]["sharded"]  # row-parallel
    assert "model.layers.0.mlp.up_proj.weight" in out[(1, 2)]["sharded"]  # column-parallel
    ref = out[(1, 1)]["weights"]
    for layout in LAYOUTS[1:]:
        got = out[layout]["weights"]
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), f"{layout}: {k}"
