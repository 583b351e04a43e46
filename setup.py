"""The package layout and the C extensions; everything else is in pyproject.toml.

The repository keeps its four layers as top-level folders (reput/, compaction/, replication/,
connectors/) and installs them under one import name, ``kcompact`` (``kcompact.reput``, ...):
``package_dir`` maps each ``kcompact.<folder>`` package to its folder, and ``kcompact/`` holds only
the facade and ``python -m kcompact``.

Each layer's kernels are a C extension next to its data: kcompact.reput._native the record and
index kernels (reput/_native.c), kcompact.compaction._native the offset map's and the cleaner's
(compaction/_native.c), kcompact.connectors.apps.kv._native the key-value map's bulk build
(connectors/apps/kv/_native.c), so that reading a store, compacting it or building the map runs
without loading numba and LLVM; kcompact.connectors.framework._rdkafka is kcompact's own Kafka
client on librdkafka's public API, reading consumed batches straight into columns and producing
columns (connectors/framework/_rdkafka.c; compiled against rdkafka.h when found, see
_rdkafka_macros). All are optional: without a C compiler the install goes on and the numba
kernels and confluent-kafka's clients are used instead (reput/jit.py,
connectors/framework/native_kafka.py). They share reput/_arr.h (1-d arrays
through the buffer protocol). kcompact.reput._native links libzstd when its header is found
(_zstd).
"""

import os

from setuptools import Extension, setup

LAYERS = ("reput", "compaction", "replication", "connectors")


def _packages() -> tuple[list[str], dict[str, str]]:
    """Every folder with an __init__.py under the layers, as kcompact.<dotted path>."""
    here = os.path.dirname(os.path.abspath(__file__))
    names, dirs = ["kcompact"], {"kcompact": "kcompact"}
    for layer in LAYERS:
        for dp, dns, files in os.walk(os.path.join(here, layer)):
            dns[:] = sorted(d for d in dns if not d.startswith((".", "__")))
            if "__init__.py" in files:
                rel = os.path.relpath(dp, here)
                name = "kcompact." + rel.replace(os.sep, ".")
                names.append(name)
                dirs[name] = rel.replace(os.sep, "/")
    return names, dirs


_FLAGS = ["-O3", "-std=c11"]


def _rdkafka_macros() -> list[tuple[str, str | None]]:
    """KC_HAVE_RDKAFKA_H when librdkafka's header is found (KCOMPACT_RDKAFKA_INCLUDE, else the
    system's include folders: Debian's librdkafka-dev, which `make install` installs). Without it,
    kcompact.connectors.framework._rdkafka is built without its own Kafka client and the
    confluent-kafka path is used (connectors/framework/native_kafka.py)."""
    dirs = [os.environ.get("KCOMPACT_RDKAFKA_INCLUDE", ""), "/usr/include", "/usr/local/include"]
    for d in filter(None, dirs):
        if os.path.exists(os.path.join(d, "librdkafka", "rdkafka.h")):
            return [("KC_HAVE_RDKAFKA_H", None)]
    return []


def _zstd() -> dict:
    """KC_HAVE_ZSTD and libzstd when zstd's header is found (KCOMPACT_ZSTD_INCLUDE, else the
    system's: Debian's libzstd-dev, which `make install` installs): kcompact.reput._native then
    decompresses a span of store format 2's zstd batches in one call, in threads
    (reput/_kafka_native.h kafka_unpack_many). Without it, one python-zstandard call a batch."""
    dirs = [os.environ.get("KCOMPACT_ZSTD_INCLUDE", ""), "/usr/include", "/usr/local/include"]
    for d in filter(None, dirs):
        if os.path.exists(os.path.join(d, "zstd.h")):
            return {"define_macros": [("KC_HAVE_ZSTD", None)], "libraries": ["zstd", "pthread"],
                    "include_dirs": ["reput", d]}
    return {}


_SHARED = {"include_dirs": ["reput"], "depends": ["reput/_arr.h", "reput/_kafka_native.h",
                                                  "reput/_kafka_span.h"],
           "optional": True}

packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=[
        Extension("kcompact.reput._native", ["reput/_native.c"], extra_compile_args=_FLAGS,
                  **{**_SHARED, **_zstd()}),
        Extension("kcompact.compaction._native", ["compaction/_native.c"],
                  extra_compile_args=_FLAGS, **_SHARED),
        Extension("kcompact.connectors.apps.kv._native", ["connectors/apps/kv/_native.c"],
                  extra_compile_args=_FLAGS, **_SHARED),
        Extension("kcompact.connectors.framework._rdkafka", ["connectors/framework/_rdkafka.c"],
                  extra_compile_args=_FLAGS + ["-D_GNU_SOURCE"], libraries=["dl"],
                  define_macros=_rdkafka_macros(),
                  include_dirs=["reput"] + list(filter(None, [
                      os.environ.get("KCOMPACT_RDKAFKA_INCLUDE")])),
                  depends=["reput/_arr.h"], optional=True),
    ],
)
