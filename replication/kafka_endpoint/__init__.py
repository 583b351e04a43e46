"""A read-only Kafka endpoint over a store (``kcompact serve --kafka-listen HOST:PORT``).

Any Kafka client (librdkafka and confluent-kafka, the Java client and its tools, Kafka Streams,
franz-go, kcat) reads a store as if it were a one-broker cluster: every topic of the store with
its partitions, records served as the store's own RecordBatch v2 bytes, consumer groups with a
coordinator whose committed offsets are kept in the store, produce refused. User guide:
docs/kafka-endpoint.md; modules: apis/ (one module per API served, its versions registered
beside its handler; apis/fetch.py writes Fetch by hand), dispatch.py (the one dispatch through
that registry), wire.py (kio glue, error codes), store_view.py (the store), groups.py (the
coordinator), server.py (connections, limits, SASL, TLS, metrics), sasl.py (users, SCRAM/PLAIN,
certificate principals), authorize.py (ACLs per API), command.py (``serve``).
"""

from .command import KafkaEndpointOptions, ServeAllOptions, run_kafka_endpoint, serve_all
from .server import Limits

__all__ = ["KafkaEndpointOptions", "Limits", "ServeAllOptions", "run_kafka_endpoint",
           "serve_all"]
