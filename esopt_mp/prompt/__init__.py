"""Prompt optimisers: the text half of a run that evolves weights and context together.

One subsystem, three words: the ``prompt`` package and config section hold the *prompt optimisers*
(``prompt.optimiser``: ``sample``, ``eoh``, ``skill``, skill synthesis being one of them); what an optimiser
evolves is the run's *context* (the text joined to every system prompt, or a program search's population), whose
versions live in ``run.dir/contexts`` and in the ledger's ``context`` fields.

A prompt optimiser reads one step's trajectories (with their returns) and the
current context and returns the next context; :class:`.run.PromptRun` applies
it on the ``prompt`` schedule, stores every version by content hash and restores
it on resume. Plain Python: no tensors, no trainer imports.
"""
from esopt_mp.prompt.base import PromptOptimiser, ContextStore, Program, Trajectory, context_hash
from esopt_mp.prompt.search import EoHSearch, SampleSearch, build_optimiser

__all__ = ["PromptOptimiser", "ContextStore", "Program", "Trajectory", "context_hash", "EoHSearch",
           "SampleSearch", "build_optimiser"]


def __getattr__(name: str):
    """The protocol's former name, kept for one release."""
    if name == "ContextOptimiser":
        import warnings
        warnings.warn("esopt_mp.prompt.ContextOptimiser is now PromptOptimiser; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return PromptOptimiser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
