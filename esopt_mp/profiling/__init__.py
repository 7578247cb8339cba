"""Memory profiling: a background sampler, Qwen3.5 shapes with random weights, the fixed workload, plots; and the
one record every benchmark prints (``record``).

``tools/memprof.py`` runs the profiles (inference, ES per precision mode,
GRPO, PPO) on the same model and episodes; see its docstring.

The names below load on first use (PEP 562), so that ``esopt_mp.profiling.record`` and ``.versions`` cost a
benchmark that never uses torch no torch import.
"""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {"MemorySampler": "sampler", "SHAPES": "shapes", "materialise": "shapes", "param_count": "shapes",
            "shape_config": "shapes", "write_random_checkpoint": "shapes", "Workload": "workload",
            "build_tokenizer": "workload", "run_rollouts": "workload"}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
