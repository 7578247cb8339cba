"""The tp-load patch of transformers (esopt_mp/models/transformers_patch.py) against the installed transformers:
this fails when an upgrade renames, re-signs or stops calling what the patch replaces."""
import inspect
import types

import pytest
import torch.distributed as dist
from transformers import modeling_utils

from esopt_mp.models import transformers_patch as tp


def test_installed_transformers_has_what_the_patch_replaces():
    cls = tp.check_patch_target()
    assert cls is modeling_utils.PreTrainedModel
    # from_pretrained still asks the patched classmethod for its mesh (else the patch would silently do nothing)
    assert f"cls.{tp.PATCHED_METHOD}(" in inspect.getsource(cls.from_pretrained)


@pytest.mark.parametrize("change", ["missing", "signature", "not_classmethod"])
def test_a_changed_target_is_one_clear_error(monkeypatch, change):
    cls = modeling_utils.PreTrainedModel
    owner = next(k for k in cls.__mro__ if tp.PATCHED_METHOD in k.__dict__)
    if change == "missing":
        monkeypatch.delattr(owner, tp.PATCHED_METHOD)
        match = "has no such attribute"
    elif change == "signature":
        monkeypatch.setattr(owner, tp.PATCHED_METHOD, classmethod(lambda c, distributed_config, device_map, plan: 0))
        match = r"takes \('distributed_config', 'device_map', 'plan'\)"
    else:
        monkeypatch.setattr(owner, tp.PATCHED_METHOD, staticmethod(lambda distributed_config, device_map=None: 0))
        match = "not a classmethod"
    with pytest.raises(tp.TransformersPatchError, match=match):
        tp.check_patch_target()


def test_patch_returns_the_sub_mesh_manager_and_is_undone():
    cls = modeling_utils.PreTrainedModel
    before = inspect.getattr_static(cls, tp.PATCHED_METHOD)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dims = types.SimpleNamespace(dp=1, tp=1, device_type="cpu")
        sentinel = object()
        with tp.patch_transformers_tp_mesh(dims, sentinel):
            config, device_map, manager = cls.prepare_distribute_model(None)
            assert config is sentinel and device_map is None
            mesh = manager.get_mesh("tp")
            assert mesh.mesh_dim_names == ("tp",) and mesh.size() == dims.tp
        assert inspect.getattr_static(cls, tp.PATCHED_METHOD) is before
        assert tp.PATCHED_METHOD not in cls.__dict__
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
