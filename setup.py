"""The package layout and the C extensions; everything else is in pyproject.toml.

The repository keeps its four layers as top-level folders (reput/, compaction/, replication/,
connectors/) and installs them under one import name, ``kcompact`` (``kcompact.reput``, ...):
``package_dir`` maps each ``kcompact.<folder>`` package to its folder, and ``kcompact/`` holds only
the facade and ``python -m kcompact``.

Each layer's kernels are a C extension next to its data: kcompact.reput._native the record and
index kernels (reput/_native.c) and store format 2's span kernels, with zstd's decoder compiled in
(reput/_kafka_native.h, _kafka_span.h; third_party/zstd), kcompact.compaction._native the offset
map's and the cleaner's (compaction/_native.c), kcompact.connectors.apps.kv._native the key-value
map's bulk build (connectors/apps/kv/_native.c); kcompact.connectors.framework._rdkafka is
kcompact's own Kafka client on librdkafka's public API, reading consumed batches straight into
columns and producing columns (connectors/framework/_rdkafka.c, compiled against the rdkafka.h
vendored in third_party/librdkafka; it dlopens confluent-kafka's librdkafka at run time). They
share reput/_arr.h (1-d arrays through the buffer protocol).

Every one is required: they are the product's kernels (docs/architecture.md, "Why each C
extension exists"), and they build from what the sdist holds, with a C compiler and Python's
headers only (no librdkafka-dev, no libzstd-dev). A machine without a compiler gets an install
that fails with one message saying what to install, never a slower kcompact that says nothing.
"""

import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


_FLAGS = ["-O3", "-std=c11", "-fvisibility=hidden"]
_ZSTD = "third_party/zstd/lib"
#: zstd's decoder (third_party/README.md): common/ without the thread pool, and decompress/ with
#: the x86-64 Huffman decoder in assembly (empty on other machines: it tests the same macro).
_ZSTD_SOURCES = sorted(
    [f"{_ZSTD}/common/{f}" for f in ("debug.c", "entropy_common.c", "error_private.c",
                                     "fse_decompress.c", "xxhash.c", "zstd_common.c")]
    + glob.glob(f"{_ZSTD}/decompress/*.c") + [f"{_ZSTD}/decompress/huf_decompress_amd64.S"])
#: zstd's symbols stay inside the extension: never resolved against a libzstd another module of
#: the process loaded, nor offered to one.
_ZSTD_MACROS = [("ZSTDLIB_VISIBLE", ""), ("ZSTDERRORLIB_VISIBLE", ""), ("XXH_NAMESPACE", "KC_ZSTD_"),
                ("ZSTD_LEGACY_SUPPORT", "0"),
                ("ZSTD_TRACE", "0")]
_SHARED = {"include_dirs": ["reput"], "depends": ["reput/_arr.h", "reput/_kafka_native.h",
                                                  "reput/_kafka_span.h"]}

_HELP = ("kcompact's C extensions are its kernels and its Kafka client; building them needs a C "
         "compiler and Python's headers, and nothing else (librdkafka's and zstd's headers are in "
         "the sdist). Install them and run pip again: apt-get install gcc python3-dev "
         "(Debian, Ubuntu), dnf install gcc python3-devel (Fedora, RHEL), apk add gcc musl-dev "
         "python3-dev (Alpine).")


class BuildExt(build_ext):
    """build_ext that compiles zstd's .S source and fails with one message that says what to
    install when an extension does not build (the compiler's own output comes before it)."""

    def build_extensions(self) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # CompileError, LinkError, a missing compiler (DistutilsExecError...)
            raise SystemExit(f"error: kcompact: building the C extension {ext.name} failed "
                             f"({type(e).__name__}: {e}). {_HELP}") from e


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension("kcompact.reput._native", ["reput/_native.c"] + _ZSTD_SOURCES,
                  extra_compile_args=_FLAGS, define_macros=_ZSTD_MACROS, libraries=["pthread"],
                  include_dirs=["reput", _ZSTD],
                  depends=_SHARED["depends"] + glob.glob(f"{_ZSTD}/*.h")
                  + glob.glob(f"{_ZSTD}/*/*.h")),
        Extension("kcompact.compaction._native", ["compaction/_native.c"],
                  extra_compile_args=_FLAGS, **_SHARED),
        Extension("kcompact.connectors.apps.kv._native", ["connectors/apps/kv/_native.c"],
                  extra_compile_args=_FLAGS, **_SHARED),
        Extension("kcompact.connectors.framework._rdkafka", ["connectors/framework/_rdkafka.c"],
                  extra_compile_args=_FLAGS + ["-D_GNU_SOURCE"], libraries=["dl", "pthread"],
                  include_dirs=["reput", "third_party/librdkafka/include"],
                  depends=["reput/_arr.h", "third_party/librdkafka/include/librdkafka/rdkafka.h"]),
    ],
)
