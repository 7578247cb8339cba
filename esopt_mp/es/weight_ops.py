"""The weight operations ES needs of an engine: one interface for the hf model and vLLM's workers.

The trainer, checkpoints and resume call only these. :class:`esopt_mp.es.Perturber` implements them on the local
shards of an hf model; :class:`esopt_mp.engine.vllm.VLLMWeights` forwards them (as seeds, never tensors) to the
same Perturber inside each vLLM worker. A new engine joins ES by providing them.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class WeightOps(Protocol):
    """Perturb, restore and update the local weights from seeds; expose their shards and state to checkpoints."""

    def perturb(self, seed: int, sigma: float, sign: int = 1) -> None:
        """Add ``sign * sigma * eps(seed)`` to every local element (eps: the layout-invariant noise)."""

    def restore(self) -> None:
        """Undo the last :meth:`perturb` (exactly under a snapshot restore or an fp32 master)."""

    def update(self, seeds: Sequence[int], signs: Sequence[int], weights: Sequence[float], alpha: float,
               weight_decay: float = 0.0, decay_to=None) -> None:
        """theta += alpha * sum_i w_i sign_i eps(seed_i) (minus the weight decay), chunk by chunk in fp32."""

    def load_state_(self, states) -> None:
        """Load the tensors :meth:`state_tensors` returned (a checkpoint's)."""

    def state_tensors(self) -> list:
        """What a checkpoint saves: the local weights (and the fp32 master, if any)."""

    @property
    def shards(self) -> list:
        """The local shards (:class:`esopt_mp.es.shard.LocalShard`): names, boxes, tensors."""

    @property
    def numel(self) -> int: ...

    @property
    def host_bytes(self) -> int: ...

    @property
    def is_perturbed(self) -> bool: ...


OPS = ("perturb", "restore", "update", "load_state_", "state_tensors", "shards", "numel", "host_bytes",
       "is_perturbed")
