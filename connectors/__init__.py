"""kcompact's Connect-style framework, its connectors and engines, and the ``kcompact`` CLI.

Public API (importable without pyspark): the connector/task model (``connectors.api``), config
definitions (``connectors.config``), converters and error handling. The worker, the store sink
and the mirror live in ``connectors.worker``, ``connectors.store_sink``, ``connectors.mirror``;
the store source and ``kcompact restore`` in ``connectors.store_source``, ``connectors.restore``.
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
