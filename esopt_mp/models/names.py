"""Canonical tensor names: the keys of the checkpoint the model was loaded from.

transformers renames checkpoint keys at load time (``conversion_mapping.py``:
e.g. a Qwen3.5 checkpoint stores its text weights under
``model.language_model.*`` and ``Qwen3_5ForCausalLM`` holds them as
``model.*``; ``save_pretrained`` renames them back). The noise spec keys eps
by the name in the checkpoint, so another engine reading the same files (vLLM)
agrees with it; this module maps each module name back to that key by running
transformers' own load-time renaming over the checkpoint's key list.
"""
from __future__ import annotations

import json
import os

INDEX = "model.safetensors.index.json"


def checkpoint_keys(path: str) -> list[str]:
    """Tensor keys of a safetensors checkpoint directory (index file, else the file headers; no data read)."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist (canonical names are its keys)")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(json.load(f)["weight_map"])
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file (canonical names are the checkpoint's keys)")
    keys = []
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            keys.extend(f.keys())
    return sorted(keys)


class CheckpointNames:
    """Module state-dict name -> checkpoint key, as ``from_pretrained`` paired them.

    Built from the checkpoint's key list and the model's registered weight
    transforms, exactly as ``convert_and_load_state_dict_in_model`` renames
    (renamings, then at most one converter, then the base-model prefix). A
    tensor produced by a ``WeightConverter`` (fused / split / stacked in the
    checkpoint) has no 1:1 key; asking for it raises.
    """

    def __init__(self, model, keys: list[str]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model, add_legacy=True)  # fresh copies: the model's stay untouched
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        prefix = getattr(model, "base_model_prefix", None) or None
        meta = dict.fromkeys(model.state_dict().keys(), True)
        self.to_key: dict[str, str] = {}
        self.converted: dict[str, list[str]] = {}
        for key in keys:
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if renamed not in meta and key in meta:  # the fallback from_pretrained takes
                renamed, pattern = rename_source_key(key, [], [], prefix, meta)
            if renamed not in meta:
                continue  # a tensor this model does not hold (e.g. a vision tower)
            if pattern is not None:
                self.converted.setdefault(renamed, []).append(key)
            elif renamed in self.to_key:
                raise ValueError(f"checkpoint keys {self.to_key[renamed]!r} and {key!r} both load into {renamed!r}")
            else:
                self.to_key[renamed] = key

    def __getitem__(self, name: str) -> str:
        if name in self.to_key:
            return self.to_key[name]
        if name in self.converted:
            raise ValueError(
                f"{name} is built at load time from checkpoint tensors {self.converted[name]} by a weight converter "
                f"(fused/split/stacked); it has no canonical checkpoint name, exclude it with es.exclude"
            )
        raise ValueError(f"{name} has no key in the checkpoint it was loaded from (no tensor loads into it)")

    def __contains__(self, name: str) -> bool:
        return name in self.to_key


def checkpoint_names(model, path: str | None = None) -> CheckpointNames:
    """Names for ``model`` from the checkpoint at ``path`` (default: the directory it was loaded from)."""
    path = path or getattr(model, "name_or_path", "") or ""
    return CheckpointNames(model, checkpoint_keys(path))
