"""The Spark engine: kcompact's batch jobs on Apache Spark through PySpark (``local[*]`` by
default, or a cluster's master with an S3 store every executor reaches).

* ``session.py``: a quiet SparkSession for kcompact (``spark_session``), whether Spark can run
  here (``spark_available``), a failed job as one line (``run_job``);
* ``source.py``: the ``kcompact`` Python data source, a store topic as a DataFrame;
* ``mirror_job.py``: ``kcompact mirror --engine spark``, one task per topic-partition;
* ``compact_job.py``: ``kcompact compact --engine spark``, one task per partition to compact.

Importing any of them loads no pyspark: a session starts only when a job needs one.
"""

from .errors import MirrorTaskError, SparkEngineError, SparkExecutorsError
from .session import spark_available, spark_session
from .source import register_data_source

__all__ = ["MirrorTaskError", "SparkEngineError", "SparkExecutorsError", "register_data_source",
           "spark_available", "spark_session"]
