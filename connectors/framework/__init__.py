"""The Connect-style framework: what runs connectors, whatever they connect.

``api`` (connector and task contracts), ``config`` (typed, validated properties), ``converters``,
``errors_handling`` (``errors.tolerance``, retries, the dead-letter topic), ``worker`` (runs
connectors' tasks in threads with their Kafka clients), and the Kafka I/O under it:
``kafka_clients`` (client settings, librdkafka's logger, error texts) and ``kafka_columns`` with
its C extension ``_rdkafka`` (consumed batches as columns, columns produced).

Nothing here knows a store, a map or a command: the connectors are in ``connectors.plugins``,
what uses them in ``connectors.apps``.
"""
