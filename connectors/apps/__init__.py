"""The applications: what each ``kcompact`` command does, each taking its typed options (a frozen
dataclass defined beside it) so that the CLI only turns flags into options.

``mirror.py`` (a topic into a store; chooses the engine: this process, or ``spark/``),
``restore.py`` (a store topic into Kafka), ``kv/`` (the LevelDB key-value map: build, follow,
get), ``spark/`` (the Spark engine: session, the ``kcompact`` data source, mirror and compaction
jobs), ``compact.py``, ``inspect.py`` (inspect, dump, verify), ``connect.py`` (``connect
standalone``); ``options.py`` and ``output.py`` hold what several of them share.
"""
