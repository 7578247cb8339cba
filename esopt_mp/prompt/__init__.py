"""Context optimisers: the text half of a run that evolves weights and context together.

A context optimiser reads one step's trajectories (with their returns) and the
current context and returns the next context; :class:`.run.ContextRun` applies
it on the ``prompt`` schedule, stores every version by content hash and restores
it on resume. Plain Python: no tensors, no trainer imports.
"""
from esopt_mp.prompt.base import ContextOptimiser, ContextStore, Program, Trajectory, context_hash
from esopt_mp.prompt.search import EoHSearch, SampleSearch, build_optimiser

__all__ = ["ContextOptimiser", "ContextStore", "Program", "Trajectory", "context_hash", "EoHSearch",
           "SampleSearch", "build_optimiser"]
