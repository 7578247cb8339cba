"""ES numerics: layout-invariant noise, seeds, shaping, schedules and the Perturber."""
from esopt_mp.es.noise import fill_, gaussian, local_noise, stream
from esopt_mp.es.perturber import Perturber, build_local_shards
from esopt_mp.es.schedules import Schedule
from esopt_mp.es.seeds import member_seed, population, splitmix64
from esopt_mp.es.shaping import shape_returns

__all__ = [
    "Perturber", "Schedule", "build_local_shards", "fill_", "gaussian",
    "local_noise", "member_seed", "population", "shape_returns", "splitmix64", "stream",
]
