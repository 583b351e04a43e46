"""Consume a compacted topic as a local key-value map (LevelDB via plyvel).

The GlobalKTable / faust Table / quixstreams State use case, built from compacted data instead of
replaying history:

* **Bulk build** (build.py, ``kcompact kv build``): decides which record is the latest per key
  from the ``.bcq`` entries alone, without decoding any record; then reads only the winners'
  bytes, sorts them by key and writes them in large WriteBatches (runs.py, kernels.py).
* **Catch-up and follow**: from the map's own offsets, from the store (build.py) or straight
  from the Kafka topic (kafka.py), one WriteBatch per batch of records with the new offsets inside
  it (connectors/plugins/leveldb_sink.py): a restart neither loses nor repeats an update.
* **Read API** (map.py): :class:`KVMap`, :class:`KVSnapshot`; ``kcompact kv get`` (command.py).
"""

from ...plugins.leveldb_sink import (KVCorruptionError, KVError, KVLockedError, KVNotFoundError,
                                     KVSourceMismatchError)
from .build import MapBuilder, build_map
from .command import KVBuildOptions, KVGetOptions, kv_build, kv_get
from .map import Following, KVMap, KVSnapshot

__all__ = ["KVMap", "KVSnapshot", "MapBuilder", "Following", "build_map", "KVBuildOptions",
           "KVGetOptions", "kv_build", "kv_get", "KVError", "KVNotFoundError",
           "KVSourceMismatchError", "KVCorruptionError", "KVLockedError"]
