"""The connectors themselves, built on connectors.framework: the store sink (Kafka -> store, what
``kcompact mirror`` runs), the store source (store -> Kafka, what ``kcompact restore`` runs) and
the LevelDB sink (Kafka -> a local key-value map). Each is named in ``connector.class`` by its
short name (the worker's ``BUILTIN_CONNECTORS``) or its dotted path.
"""
