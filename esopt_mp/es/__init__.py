"""ES numerics: layout-invariant noise, seeds, shaping, schedules and the Perturber.

The names below load on first use (PEP 562), so importing a light submodule (``esopt_mp.es.config``) loads no torch.
"""
from esopt_mp.lazy import lazy_exports

_EXPORTS = {
    "fill_": "noise", "gaussian": "noise", "local_noise": "noise", "stream": "noise",
    "Perturber": "perturber", "build_local_shards": "shard",
    "Schedule": "seeds", "member_seed": "seeds", "population": "seeds", "splitmix64": "seeds",
    "shape_returns": "shaping", "WeightOps": "weight_ops",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
