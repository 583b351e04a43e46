"""Only the C extensions live here; everything else is in pyproject.toml.

reput._native holds the compaction kernels in C (reput/_native.c), so that a compaction runs
without loading numba and LLVM. connectors._rdkafka reads consumed Kafka batches straight into
columns (connectors/_rdkafka.c). Both are optional: without a C compiler the install goes on and
the numba kernels and confluent_kafka's Message objects are used instead (reput/_jit.py,
connectors/kafka_columns.py).
"""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11"]

_SHARED = {"include_dirs": ["reput"], "depends": ["reput/_arr.h"], "optional": True}

setup(ext_modules=[
    Extension("reput._native", ["reput/_native.c"], extra_compile_args=_FLAGS, **_SHARED),
    Extension("connectors._rdkafka", ["connectors/_rdkafka.c"],
              extra_compile_args=_FLAGS + ["-D_GNU_SOURCE"], libraries=["dl"], **_SHARED),
])
