"""kcompact's Connect-style framework, its connectors, the applications built on them and the
``kcompact`` CLI.

The names below are the framework's public API (importable without pyspark): the connector and
task model, config definitions, converters and the package's errors. The framework lives in
``kcompact.connectors.framework`` (api, config, converters, error handling, the worker, Kafka I/O).
"""

from .framework.api import (OFFSET_BEGINNING, ConnectRecord, Connector, DataError, RetriableError,
                            SinkConnector, SinkRecord, SinkRecords, SinkTask, SinkTaskContext,
                            SourceConnector, SourceRecord, SourceTask, SourceTaskContext, Task,
                            TaskFailedError, TopicPartition)
from .framework.config import (ConfigDef, ConfigKey, Importance, Type, load_config_file,
                               parse_properties)
from .framework.converters import (AvroConverter, ByteArrayConverter, Converter, JsonConverter,
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
