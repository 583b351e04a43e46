"""Shared pytest configuration.

Every test runs by default, the ``slow`` ones included (the 10M-record exact-rounds compaction
and the five-SIGKILL mirror are acceptance tests of their issues; together about a minute).
Deselect them for a quick local loop with ``pytest -m "not slow"``.
"""

import os

# Every Spark JVM the tests start (the driver of each `--engine spark` command and of the
# tests' own sessions, and the executors) compiles with C1 only: the tests' Spark jobs are
# short, and C2's compiler threads were about a third of each one's CPU on the 2 cores
# (a `compact --engine spark` of 4 partitions: 15 core-seconds against 22-26). Set it yourself
# to run them with Spark's JIT as users have it.
os.environ.setdefault("KCOMPACT_SPARK_JAVA_OPTIONS", "-XX:TieredStopAtLevel=1")
