"""Store format 2's batch codecs, framed as Kafka frames them (docs/formats/segment-v2.md,
"Codecs, as Kafka frames them").

gzip, snappy (xerial framing) and lz4 (independent blocks) go through cramjam; zstd (the default
codec, and the lean index's) through python-zstandard with one compression and one
decompression context per thread, reused: a context's creation costs as much as decompressing
8 KiB of it (cramjam makes one per call: a 32 KiB batch decompressed in ~24 us against ~15 us),
and a one-record read decompresses one batch. reput/batch.py encodes and decodes batches with
these; reput/_kafka_span.h decompresses a span of zstd batches in one call, through the zstd
decoder compiled into kcompact.reput._native (third_party/zstd): :func:`zstd_path` names it.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from .errors import CorruptRecordError, ReputError

CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD = 0, 1, 2, 3, 4
CODEC_NAMES = {CODEC_NONE: "uncompressed", CODEC_GZIP: "gzip", CODEC_SNAPPY: "snappy",
               CODEC_LZ4: "lz4", CODEC_ZSTD: "zstd"}
CODEC_BY_NAME = {v: k for k, v in CODEC_NAMES.items()}
#: snappy-java's stream header (xerial framing, what Kafka writes for snappy)
XERIAL_HEADER = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
XERIAL_BLOCK = 32 * 1024


def zstd_path() -> str:
    """How a span of zstd batches is read, for ``kcompact --version``: in one call on the zstd
    decoder compiled into kcompact.reput._native (its version); a single batch goes through
    python-zstandard."""
    from . import _native
    return f"bulk (vendored {_native.ZSTD_VERSION}, compiled into kcompact.reput._native)"


#: a lean index's ``target`` (docs/formats/bcq-v2.md): what its segment was written for. 0: not
#: recorded (an older kcompact); 1 + a codec id: that compression.type; TARGET_PRODUCER:
#: ``producer`` (the source's codec kept)
TARGET_UNKNOWN, TARGET_PRODUCER = 0, 6


def codec_of(compression_type: str, source: int | None = None) -> int:
    """The codec id batches are written with for a topic's ``compression.type``. ``producer``
    (Kafka's meaning: each batch keeps its source batch's codec) gives ``source``, the codec of
    the stored batches being rewritten, and none when there is none to keep: records that came
    from a Kafka consumer, which no client API tells the codec of its batches (a mirror of a
    source topic whose compression.type names a codec syncs it: docs/mirror.md)."""
    if compression_type == "producer":
        return CODEC_NONE if source is None else int(source)
    try:
        return CODEC_BY_NAME[compression_type]
    except KeyError:
        raise ReputError(f"unknown compression.type {compression_type!r}; use one of "
                         + ", ".join(sorted(CODEC_BY_NAME))) from None


def target_of(compression_type: str) -> int:
    """The lean index ``target`` of a segment written for ``compression_type``."""
    return TARGET_PRODUCER if compression_type == "producer" else 1 + codec_of(compression_type)


def needs_recode(compression_type: str, codec: int, target: int) -> bool:
    """Whether a stored segment (its lean index's ``codec`` and ``target``) must be re-encoded
    for the topic's ``compression_type`` even when compaction drops none of its records: it
    was written for another compression.type. ``producer`` never asks (stored batches keep
    their codec); a segment of an older kcompact (no target) is re-encoded when its codec is
    not the one asked for (once: the new one records its target)."""
    if compression_type == "producer":
        return False
    want = target_of(compression_type)
    if target != TARGET_UNKNOWN:
        return target != want
    return codec != want - 1


def _cramjam():
    try:
        import cramjam
    except ImportError as e:  # a dependency of kcompact: only a broken install lacks it
        raise ReputError(f"store format 2 needs cramjam: pip install 'cramjam>=2.8' ({e})") \
            from None
    return cramjam


def _zstandard():
    try:
        import zstandard
    except ImportError as e:  # a dependency of kcompact: only a broken install lacks it
        raise ReputError("store format 2 needs zstandard: pip install 'zstandard>=0.22' "
                         f"({e})") from None
    return zstandard


_tls = threading.local()
#: a zstd frame's declared content size above this is refused before anything is allocated (a
#: batch holds compression.batch.bytes, or one record larger than that; the CRC was checked)
ZSTD_MAX_CONTENT = 1 << 30


def zstd_compress(data, level: int) -> bytes:
    """zstd frame of ``data`` (content size in the frame header), through this thread's context
    for ``level``."""
    ctxs = getattr(_tls, "zc", None)
    if ctxs is None:
        ctxs = _tls.zc = {}
    c = ctxs.get(level)
    if c is None:
        c = ctxs[level] = _zstandard().ZstdCompressor(level=level)
    return c.compress(data)


def zstd_decompress(data) -> bytes:
    """The content of the zstd frames in ``data``, through this thread's decompression context.
    Raises ValueError (or zstandard's ZstdError) when they do not decode whole."""
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = _zstandard().ZstdDecompressor()
    size = _zstandard().frame_content_size(data)
    if size > ZSTD_MAX_CONTENT:
        raise ValueError(f"the frame declares {size} bytes of content")
    if size >= 0:  # what kcompact writes: one frame, its size declared
        return d.decompress(data)
    # a streaming writer's frames (size not declared), one after the other
    parts, rest = [], data
    while True:
        o = d.decompressobj()
        parts.append(o.decompress(rest))
        if not o.eof:
            raise ValueError("the frame is cut short")
        rest = o.unused_data
        if not rest:
            return b"".join(parts)


def compress(codec: int, data, level: int = 3) -> bytes:
    cj = _cramjam()
    if codec == CODEC_ZSTD:
        return zstd_compress(data, level)
    if codec == CODEC_GZIP:
        return bytes(cj.gzip.compress(data))
    if codec == CODEC_LZ4:
        # Kafka's reader (KafkaLZ4BlockInputStream) takes independent blocks only
        c = cj.lz4.Compressor(content_checksum=False, block_linked=False)
        c.compress(data.tobytes() if isinstance(data, np.ndarray) else bytes(data))
        return bytes(c.finish())
    if codec == CODEC_SNAPPY:
        mv = memoryview(data).cast("B")
        parts = [XERIAL_HEADER]
        for i in range(0, len(mv), XERIAL_BLOCK):
            block = bytes(cj.snappy.compress_raw(mv[i:i + XERIAL_BLOCK]))
            parts.append(struct.pack(">i", len(block)))
            parts.append(block)
        return b"".join(parts)
    raise ReputError(f"codec {codec} cannot compress")


def decompress(codec: int, data, where: str, pos: int) -> np.ndarray:
    """The records of a batch's payload (raises CorruptRecordError when it does not decode)."""
    cj = _cramjam()
    try:
        if codec == CODEC_ZSTD:
            out = zstd_decompress(data)
        elif codec == CODEC_GZIP:
            out = cj.gzip.decompress(data)
        elif codec == CODEC_LZ4:
            out = cj.lz4.decompress(data)
        elif codec == CODEC_SNAPPY:
            out = _xerial_decompress(cj, bytes(data))
        else:
            raise CorruptRecordError(f"{where}: unknown codec {codec} in the batch at byte {pos}",
                                     where, pos)
    except CorruptRecordError:
        raise
    except Exception as e:  # noqa: BLE001 - each library raises its own
        raise CorruptRecordError(f"{where}: the batch at byte {pos} does not decompress "
                                 f"({CODEC_NAMES.get(codec, codec)}: {e})", where, pos) from None
    return np.frombuffer(bytes(out), np.uint8)


def _xerial_decompress(cj, raw: bytes) -> bytes:
    if not raw.startswith(XERIAL_HEADER[:8]):
        return bytes(cj.snappy.decompress_raw(raw))  # a plain snappy block (other writers)
    p, parts = 16, []
    while p < len(raw):
        if p + 4 > len(raw):
            raise ValueError("xerial block length runs past the payload")
        (n,) = struct.unpack_from(">i", raw, p)
        p += 4
        if n < 0 or p + n > len(raw):
            raise ValueError("xerial block runs past the payload")
        parts.append(bytes(cj.snappy.decompress_raw(raw[p:p + n])))
        p += n
    return b"".join(parts)


__all__ = ["CODEC_BY_NAME", "CODEC_GZIP", "CODEC_LZ4", "CODEC_NAMES", "CODEC_NONE",
           "CODEC_SNAPPY", "CODEC_ZSTD", "TARGET_PRODUCER", "TARGET_UNKNOWN", "ZSTD_MAX_CONTENT", "codec_of", "needs_recode", "target_of", "compress", "decompress",
           "zstd_compress", "zstd_decompress"]
