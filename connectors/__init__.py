"""kcompact's Connect-style framework, its connectors and engines, and the ``kcompact`` CLI.

Public API (importable without pyspark): the connector/task model (``kcompact.connectors.api``), config
definitions (``kcompact.connectors.config``), converters and error handling. The worker, the store sink
and the mirror live in ``kcompact.connectors.worker``, ``kcompact.connectors.store_sink``, ``kcompact.connectors.mirror``;
the store source and ``kcompact restore`` in ``kcompact.connectors.store_source``, ``kcompact.connectors.restore``.
"""

from .api import (OFFSET_BEGINNING, ConnectRecord, Connector, DataError, RetriableError,
                  SinkConnector, SinkRecord, SinkRecords, SinkTask, SinkTaskContext,
                  SourceConnector, SourceRecord, SourceTask, SourceTaskContext, Task,
                  TaskFailedError, TopicPartition)
from .config import ConfigDef, ConfigKey, Importance, Type, load_config_file, parse_properties
from .converters import (AvroConverter, ByteArrayConverter, Converter, JsonConverter,
                         StringConverter)
from .errors import ConfigError, ConnectorsError

__all__ = [
    "OFFSET_BEGINNING", "ConnectRecord", "Connector", "DataError", "RetriableError",
    "SinkConnector", "SinkRecord", "SinkRecords", "SinkTask", "SinkTaskContext",
    "SourceConnector", "SourceRecord", "SourceTask", "SourceTaskContext", "Task",
    "TaskFailedError", "TopicPartition",
    "ConfigDef", "ConfigKey", "Importance", "Type", "load_config_file", "parse_properties",
    "AvroConverter", "ByteArrayConverter", "Converter", "JsonConverter", "StringConverter",
    "ConfigError", "ConnectorsError",
]
