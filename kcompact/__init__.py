"""kcompact: a compacted copy of Kafka topics in RocketMQ-style storage.

One import name for the four layers, each a folder at the top of the repository (ARCHITECTURE.md):
``kcompact.reput`` (storage), ``kcompact.compaction``, ``kcompact.replication`` and
``kcompact.connectors`` (Connect-style framework, connectors, applications and the CLI).
Dependencies point one way: connectors -> replication -> compaction -> reput.

The names below are the facade for README's Python examples; they load on first use, so
``import kcompact`` stays cheap for the command line::

    from kcompact import Store, RecordBatch, KVMap
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _dist_version
from typing import Any

try:
    __version__ = _dist_version("kcompact")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_FACADE = {
    "KcompactError": "kcompact.errors",
    "ConfigError": "kcompact.errors",
    "Store": "kcompact.reput",
    "Record": "kcompact.reput",
    "RecordBatch": "kcompact.reput",
    "BytesColumn": "kcompact.reput",
    "RecordColumns": "kcompact.reput",
    "PartitionReader": "kcompact.reput",
    "TopicConfig": "kcompact.reput",
    "ManualClock": "kcompact.reput",
    "verify_store": "kcompact.reput",
    "ReputError": "kcompact.reput",
    "Compactor": "kcompact.compaction",
    "CompactionOptions": "kcompact.compaction",
    "compact_store": "kcompact.compaction",
    "CompactionError": "kcompact.compaction",
    "ReplicationError": "kcompact.replication",
    "KVMap": "kcompact.connectors.apps.kv",
    "spark_session": "kcompact.connectors.apps.spark",
    "register_data_source": "kcompact.connectors.apps.spark",
    "ConnectorsError": "kcompact.connectors",
}

__all__ = ["__version__", *_FACADE]


def __getattr__(name: str) -> Any:
    module = _FACADE.get(name)
    if module is None:
        raise AttributeError(f"module 'kcompact' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
