"""Memory profiling: a background sampler, Qwen3.5 shapes with random weights, the fixed workload, plots.

``tools/memprof.py`` runs the profiles (inference, ES per precision mode,
GRPO, PPO) on the same model and episodes; see its docstring.
"""
from esopt_mp.profiling.sampler import MemorySampler
from esopt_mp.profiling.shapes import SHAPES, materialise, param_count, shape_config, write_random_checkpoint
from esopt_mp.profiling.workload import Workload, build_tokenizer, run_rollouts

__all__ = ["SHAPES", "MemorySampler", "Workload", "build_tokenizer", "materialise", "param_count", "run_rollouts",
           "shape_config", "write_random_checkpoint"]
