"""The one place esopt_mp patches transformers: ``PreTrainedModel.prepare_distribute_model``, during a tp load.

What: transformers' ``from_pretrained`` asks the classmethod ``prepare_distribute_model(distributed_config,
device_map=None)`` (defined on its ``DistributedMixin``) for ``(distributed_config, device_map, mesh manager)``
and shards the model over that manager's ``tp`` mesh. For the length of one ``from_pretrained`` call,
:func:`patch_transformers_tp_mesh` replaces it with one that returns a ``TransformersDeviceMesh`` whose ``tp``
view is this rank's tp sub-mesh, then puts the original back.

Why: transformers' native tensor parallelism (``DistributedConfig``) builds its mesh over the *whole* world; ES
needs TP inside each data-parallel group. Everything else (the model's own ``base_model_tp_plan``, sharded
loading, DTensor parameters) stays transformers' code path.

A transformers release that renames the method, changes its parameters or the mesh manager's constructor makes
the patch fail loudly at load time (:class:`TransformersPatchError`) instead of sharding over the wrong mesh.
"""
from __future__ import annotations

import contextlib
import inspect

PATCHED_METHOD = "prepare_distribute_model"
EXPECTED_PARAMS = ("distributed_config", "device_map")  # after cls
MESH_PARAMS = ("dense_mesh", "expert_mesh")  # TransformersDeviceMesh(...)


class TransformersPatchError(RuntimeError):
    """The installed transformers no longer has what the tp-load patch replaces."""


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def check_patch_target():
    """The class to patch (``transformers.modeling_utils.PreTrainedModel``), after checking that its
    ``prepare_distribute_model`` is a classmethod taking :data:`EXPECTED_PARAMS` and that
    ``TransformersDeviceMesh`` takes :data:`MESH_PARAMS`; :class:`TransformersPatchError` otherwise."""
    import transformers
    from transformers import modeling_utils

    where = (f"transformers {transformers.__version__}: esopt_mp's tp loading (parallel.tp > 1) replaces "
             f"PreTrainedModel.{PATCHED_METHOD} (esopt_mp/models/transformers_patch.py), but")
    cls = modeling_utils.PreTrainedModel
    try:
        static = inspect.getattr_static(cls, PATCHED_METHOD)
    except AttributeError:
        raise TransformersPatchError(f"{where} the class has no such attribute") from None
    if not isinstance(static, classmethod):
        raise TransformersPatchError(f"{where} it is a {type(static).__name__}, not a classmethod")
    got = _params(getattr(cls, PATCHED_METHOD))
    if got != EXPECTED_PARAMS:
        raise TransformersPatchError(f"{where} it takes {got}, expected {EXPECTED_PARAMS}")
    try:
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError as e:
        raise TransformersPatchError(f"{where} transformers.distributed.utils.TransformersDeviceMesh is gone ({e})") \
            from None
    mesh = _params(TransformersDeviceMesh)
    if mesh != MESH_PARAMS:
        raise TransformersPatchError(f"{where} TransformersDeviceMesh takes {mesh}, expected {MESH_PARAMS}")
    return cls


@contextlib.contextmanager
def patch_transformers_tp_mesh(dims, distributed_config):
    """Make ``from_pretrained`` inside the block shard over ``dims``' tp sub-mesh instead of the whole world."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.utils import TransformersDeviceMesh

    cls = check_patch_target()
    shape = (1, dims.dp, 1, dims.tp)
    dense = init_device_mesh(dims.device_type, shape, mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    expert = init_device_mesh(dims.device_type, shape, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    manager = TransformersDeviceMesh(dense, expert)
    original = cls.__dict__.get(PATCHED_METHOD)  # None: it lives on a mixin base, and deleting ours restores it

    def prepare(klass, config, device_map=None):
        device_map = torch.device("cuda", torch.cuda.current_device()) if dims.device_type == "cuda" else None
        return distributed_config, device_map, manager

    setattr(cls, PATCHED_METHOD, classmethod(prepare))
    try:
        yield
    finally:
        if original is None:
            delattr(cls, PATCHED_METHOD)
        else:
            setattr(cls, PATCHED_METHOD, original)
