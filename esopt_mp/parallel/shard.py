"""The shard description's former home: it is :mod:`esopt_mp.es.shard` (the noise addresses every shard by it).
Kept so that ``from esopt_mp.parallel.shard import ShardInfo`` goes on working; new code imports ``es.shard``."""
from esopt_mp.es.shard import LocalShard, ShardInfo  # noqa: F401
