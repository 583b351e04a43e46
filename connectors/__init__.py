"""kcompact's Connect-style framework, its connectors, the applications built on them and the
``kcompact`` CLI, one folder per kind of thing (dependencies point down this list):

* ``cli.py``: the command line, argparse only (flags -> typed options -> an application);
* ``devtools/``: the embedded broker, SeaweedFS, the demo (the ``dev`` extra);
* ``apps/``: what each command does (mirror, restore, kv, spark, compact, inspect, connect);
* ``plugins/``: the connectors (store sink, store source, LevelDB sink);
* ``framework/``: the connector and task API, configs, converters, error handling and the
  dead-letter topic, the worker, Kafka I/O;
* ``errors.py`` (the package's root errors), ``extras.py`` (optional dependencies).

The names below are the framework's public API (importable without pyspark).
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
