"""The shard description's former home: it is :mod:`esopt_mp.es.shard` (the noise addresses every shard by it).
Kept one release so that ``from esopt_mp.parallel.shard import ShardInfo`` goes on working, with a one-line notice."""
import warnings

from esopt_mp.es.shard import LocalShard, ShardInfo  # noqa: F401

warnings.warn("esopt_mp.parallel.shard is now esopt_mp.es.shard: import it from there (the old name goes in the "
              "next release)", DeprecationWarning, stacklevel=2)
