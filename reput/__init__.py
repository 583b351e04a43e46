"""kcompact's storage layer: records, commit log, reput, compaction logs and .bcq indexes.

Nothing here imports from compaction/, replication/ or connectors/.
"""

from .backend import AppendFile, Backend, BackendError, LocalBackend, MemoryBackend
from .bcq import BCQ_DTYPE, FLAG_KEYLESS, FLAG_TOMBSTONE, lower_bound
from .config import Clock, ConfigError, ManualClock, SYSTEM_CLOCK, TopicConfig, WriterOptions
from .errors import (CorruptRecordError, InvalidTopicError, OffsetOrderError, ReputError,
                     StoreFormatError, StoreLockedError, StoreNotFoundError)
from .partition import PartitionLog
from .reader import IndexCursor, PartitionReader, RecordColumns
from .record import (BytesColumn, Record, RecordBatch, decode_one, encode, encode_batch, key_digest,
                     scan)
from .store import FORMAT_VERSION, KNOWN_FORMAT_VERSION, Store, StoreMeta, backend_for
from .verify import Problem, VerifyReport, verify_store

__all__ = [
    "AppendFile", "Backend", "BackendError", "LocalBackend", "MemoryBackend",
    "BCQ_DTYPE", "FLAG_KEYLESS", "FLAG_TOMBSTONE", "lower_bound",
    "Clock", "ConfigError", "ManualClock", "SYSTEM_CLOCK", "TopicConfig", "WriterOptions",
    "CorruptRecordError", "InvalidTopicError", "OffsetOrderError", "ReputError",
    "StoreFormatError", "StoreLockedError", "StoreNotFoundError",
    "PartitionLog", "IndexCursor", "PartitionReader", "RecordColumns",
    "BytesColumn", "Record", "RecordBatch", "decode_one", "encode", "encode_batch", "key_digest",
    "scan",
    "FORMAT_VERSION", "KNOWN_FORMAT_VERSION", "Store", "StoreMeta", "backend_for",
    "Problem", "VerifyReport", "verify_store",
]
