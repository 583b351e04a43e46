"""The store source: a kcompact store -> a Kafka topic (what ``kcompact restore`` runs).

* ``connector.py``: :class:`StoreSourceConnector`, its properties, and the runner it brings;
* ``task.py``: :class:`StoreSourceTask`, which plans a store topic's records (latest per key, or
  all) from recorded positions and hands them out in chunks (``chunks.py``: columns, no object
  per record);
* ``runner.py``: :class:`RestoreRunner`, what the worker runs for the connector - the producer,
  the target topic, transactions and progress (``progress.py``: progress records, in the store
  and on the target cluster, docs/formats/restore-progress.md; ``kafka.py``: topics and the one
  line a Kafka failure is reported as);
* ``kernels.py``: Kafka's default partitioner (murmur2) and the offset check, compiled.
"""

from .connector import STORE_SOURCE_CONFIG, StoreSourceConnector
from .errors import ProgressFormatError, RestoreError
from .kernels import default_partition, murmur2
from .progress import PROGRESS_TOPIC
from .runner import DEFAULT_PRODUCER_CONFIG, RestoreRunner
from .task import StoreSourceTask

__all__ = ["DEFAULT_PRODUCER_CONFIG", "PROGRESS_TOPIC", "STORE_SOURCE_CONFIG",
           "ProgressFormatError", "RestoreError", "RestoreRunner", "StoreSourceConnector",
           "StoreSourceTask", "default_partition", "murmur2"]
