"""The data path's Kafka clients: kcompact's own, on librdkafka's public API (_rdkafka.c).

The mirror's and the sink tasks' consumer, the KV follower's consumer and restore's producer
(transactions included) are made by :func:`kafka_consumer` / :func:`kafka_producer`:
:class:`NativeConsumer` / :class:`NativeProducer`, an rd_kafka_t that kcompact creates itself
through rdkafka.h (``_rdkafka.Client``). Batches are consumed into columns with the GIL released
(:meth:`NativeConsumer.consume_columns`) and columns are produced without a Python object per
record (:meth:`NativeProducer.produce_columns`). Their other methods are the confluent-kafka ones
the callers use (same names, arguments, return values and exceptions: ``KafkaException`` carrying
a ``KafkaError``). This is the one data path: confluent-kafka's ``Consumer.consume`` and
per-record ``Producer.produce`` were a second one until issue 39 (``KCOMPACT_KAFKA_IO`` chose;
setting it now only prints a warning that it is gone). confluent-kafka stays for what it does
best: admin, metadata, the Schema Registry, the progress topic and the dead-letter producer.

The library (:func:`library_path`): ``KCOMPACT_LIBRDKAFKA`` when set; else the librdkafka that
confluent-kafka's wheel ships (``confluent_kafka.libs/librdkafka*.so*``, found through
``importlib.metadata``: the one confluent-kafka itself runs on); else the system's
(``ctypes.util.find_library("rdkafka")``). It must be at least as new as the rdkafka.h the
extension was compiled with (librdkafka 2.6.0's, vendored in third_party/: checked at load with
``rd_kafka_version()``). When none loads, making a client raises a ConfigError naming why, and
``kcompact --version`` says so (:func:`describe`).

Callbacks (``error_cb``, ``logger``, ``stats_cb``, ``on_delivery`` in the configuration, as for
confluent-kafka) run on the calling thread after the call that served their events; one that
raises makes that call raise (a consumed batch is then dropped, as in confluent-kafka).
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
import threading
import uuid
from importlib import metadata
from typing import Any, NamedTuple, Sequence

import numpy as np

from kcompact.reput import env as _env

from ..errors import ConfigError
from .kafka_columns import Batch, Event

#: The environment variable that chose between two data paths until issue 39 (now a warning).
IO_ENV = "KCOMPACT_KAFKA_IO"
#: The environment variable naming a librdkafka shared library to load instead.
LIB_ENV = "KCOMPACT_LIBRDKAFKA"
#: Configuration keys that hold Python callables (handled here, never given to librdkafka).
_CALLBACK_KEYS = ("error_cb", "logger", "stats_cb", "on_delivery")
_UNSUPPORTED_KEYS = ("throttle_cb", "oauth_cb", "on_commit", "dr_cb", "dr_msg_cb")

_loaded: Any = None   # the extension once librdkafka is loaded; False when it cannot be
_why_not = ""         # why not, for the error and `kcompact --version`
_warned = False
_load_lock = threading.Lock()


def library_path() -> str | None:
    """The librdkafka to load (see the module docstring for the order), or None."""
    env = _env.value(LIB_ENV)
    if env:
        return env
    try:
        files = metadata.files("confluent-kafka") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        parts = f.parts
        if len(parts) == 2 and parts[0] == "confluent_kafka.libs" and \
                parts[1].startswith("librdkafka") and ".so" in parts[1]:
            return str(f.locate())
    return ctypes.util.find_library("rdkafka")


def _native_module() -> Any:
    """The extension with librdkafka loaded, or None (the reason in _why_not). Thread-safe: the
    tasks of one worker open their clients at once, and a task must not see the load half done."""
    with _load_lock:
        return _load_native()


def _load_native() -> Any:
    global _loaded, _why_not
    if _loaded is None:
        _loaded = False
        try:
            from . import _rdkafka
        except ImportError as e:
            _why_not = f"the C extension is not built ({e})"
            return None
        path = library_path()
        if path is None:
            _why_not = ("no librdkafka found (confluent-kafka's wheel has none: install "
                        f"confluent-kafka from its wheel, or set {LIB_ENV} to a librdkafka "
                        "2.6.0 or newer)")
            return None
        try:
            _rdkafka.load(path)
        except OSError as e:
            _why_not = str(e)
            return None
        _loaded = _rdkafka
    return _loaded or None


def _warn_if_io_env() -> None:
    """One line, once a process, for a user who still sets KCOMPACT_KAFKA_IO."""
    global _warned
    if not _warned and os.environ.get(IO_ENV, "").strip():
        _warned = True
        print(f"kcompact: warning: {IO_ENV} is gone and ignored: the data path always runs on "
              "kcompact's own Kafka client (see `kcompact --version`); unset it",
              file=sys.stderr, flush=True)


def describe() -> str:
    """The data path's Kafka client in one line, for ``kcompact --version``."""
    _warn_if_io_env()
    if _native_module() is None:
        return f"UNAVAILABLE: {_why_not}"
    path = library_path() or ""
    where = (f"{LIB_ENV}={path}" if os.environ.get(LIB_ENV) else
             f"via confluent-kafka {metadata.version('confluent-kafka')}"
             if "confluent_kafka.libs" in path else path)
    from . import _rdkafka
    h = _rdkafka.HEADER_VERSION
    return (f"native (librdkafka {librdkafka_version()} {where}; built against rdkafka.h "
            f"{h >> 24 & 0xff}.{h >> 16 & 0xff}.{h >> 8 & 0xff})")


def librdkafka_version() -> str | None:
    """The version of the librdkafka the native clients run on, or None when not loaded."""
    mod = _native_module()
    return None if mod is None else mod.load(library_path() or "")


def kafka_consumer(conf: dict[str, Any]) -> "NativeConsumer":
    """The data path's consumer. Raises KafkaException for a setting librdkafka refuses,
    ConfigError when no librdkafka loads."""
    return NativeConsumer(conf)


def kafka_producer(conf: dict[str, Any]) -> "NativeProducer":
    """The data path's producer (restore's)."""
    return NativeProducer(conf)


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _exception(e: BaseException) -> Exception:
    """_rdkafka.KafkaIOError(code, reason, fatal, retriable, txn_requires_abort) as
    confluent-kafka's KafkaException."""
    from confluent_kafka import KafkaError, KafkaException
    code, reason, fatal, retriable, abort = e.args
    return KafkaException(KafkaError(code, reason, fatal=bool(fatal), retriable=bool(retriable),
                                     txn_requires_abort=bool(abort)))


def _ms(timeout: float | None) -> int:
    """confluent-kafka's seconds (None or negative: infinite) as librdkafka's milliseconds."""
    if timeout is None or timeout < 0:
        return -1
    return min(int(timeout * 1000), 2**31 - 1)


#: syslog levels (librdkafka's) -> logging levels, as confluent-kafka maps them
_LEVELS = {0: logging.CRITICAL, 1: logging.CRITICAL, 2: logging.CRITICAL, 3: logging.ERROR,
           4: logging.WARNING, 5: logging.INFO, 6: logging.INFO, 7: logging.DEBUG}


class DeliveryReport(NamedTuple):
    """The message of a failed delivery, as an ``on_delivery`` callable reads it (the topic,
    partition and offset of confluent-kafka's Message, and its error)."""
    topic_: str
    partition_: int
    offset_: int
    error_: Any

    def topic(self) -> str:
        return self.topic_

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def error(self) -> Any:
        return self.error_


class TopicMetadata(NamedTuple):
    """One topic of :meth:`NativeClient.list_topics` (confluent-kafka's fields the callers read)."""
    topic: str
    partitions: dict
    error: Any


class ClusterMetadata(NamedTuple):
    cluster_id: str | None
    topics: dict


class NativeClient:
    """What :class:`NativeConsumer` and :class:`NativeProducer` share: the configuration, the
    callbacks, metadata, close()."""

    _KIND = -1

    def __init__(self, conf: dict[str, Any]):
        from confluent_kafka import KafkaError, KafkaException
        _warn_if_io_env()
        mod = _native_module()
        if mod is None:
            raise ConfigError(f"kcompact's Kafka client cannot run: {_why_not}")
        conf = dict(conf)
        for k in _UNSUPPORTED_KEYS:
            if k in conf:
                raise KafkaException(KafkaError(
                    KafkaError._INVALID_ARG, f'"{k}" is not supported by kcompact\'s Kafka '
                    "client"))
        self._error_cb = conf.pop("error_cb", None)
        self._logger = conf.pop("logger", None)
        self._stats_cb = conf.pop("stats_cb", None)
        self._on_delivery = conf.pop("on_delivery", None)
        self._prepare(conf)
        logs = self._logger is not None and self._logger.isEnabledFor(logging.CRITICAL)
        self._mod = mod
        try:
            self._h = mod.Client(self._KIND, {k: _text(v) for k, v in conf.items()}, logs,
                                 self._stats_cb is not None)
        except mod.KafkaIOError as e:
            raise _exception(e) from None
        self._dispatch()

    def _prepare(self, conf: dict[str, Any]) -> None:
        """Settings this kind of client adds before librdkafka sees them."""

    def _call(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the client, its KafkaIOError as KafkaException, then the callbacks."""
        try:
            out = fn(*args)
        except self._mod.KafkaIOError as e:
            self._dispatch()
            raise _exception(e) from None
        self._dispatch()
        return out

    def _dispatch(self) -> None:
        """Call the application's callables for what librdkafka reported since the last call."""
        got = self._h.drain()
        if got is None:
            return
        from confluent_kafka import KafkaError
        errors, logs, stats, failures = got
        if self._logger is not None:
            for level, fac, text in logs:
                self._logger.log(_LEVELS.get(level, logging.INFO), "%s: %s", fac, text)
        for code, reason, fatal in errors:
            if self._error_cb is not None:
                self._error_cb(KafkaError(code, reason, fatal=fatal))
        for s in stats:
            self._stats_cb(s)
        if self._on_delivery is not None:
            for code, reason, topic, part, off in failures:
                err = KafkaError(code, reason)
                self._on_delivery(err, DeliveryReport(topic, part, off, err))

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> ClusterMetadata:
        """Metadata of ``topic`` (never auto-created) or of all topics, as confluent-kafka's
        ``list_topics`` (the fields kcompact reads: cluster_id, topics[t].partitions, .error)."""
        from confluent_kafka import KafkaError
        cid, topics = self._call(self._h.metadata, topic, _ms(timeout))
        return ClusterMetadata(cid, {
            name: TopicMetadata(name, dict.fromkeys(parts),
                                KafkaError(err) if err else None)
            for name, err, parts in topics})

    def close(self) -> None:
        self._h.close()
        self._dispatch()


class NativeConsumer(NativeClient):
    """A consumer on kcompact's own rd_kafka_t: ``consume_columns`` and the confluent-kafka
    Consumer methods the data path uses (assign, pause, get_watermark_offsets, list_topics,
    commit, close). It never subscribes: partitions are assigned."""

    _KIND = 1

    def _prepare(self, conf: dict[str, Any]) -> None:
        # the consumer queue belongs to the group: a consumer that only assigns still needs one
        conf.setdefault("group.id", f"kcompact-{uuid.uuid4().hex[:12]}")

    def consume_columns(self, num_messages: int, timeout: float) -> Batch:
        """Up to ``num_messages`` records as columns, waiting up to ``timeout`` seconds for the
        first; error messages (end of partition ...) as ``Batch.events``."""
        (parts, offs, ts, names, tindex, kb, ko, kn, vb, vo, vn, hb, ho,
         events) = self._call(self._h.consume, num_messages, max(0, _ms(timeout)))
        return Batch(np.frombuffer(parts, np.int32), np.frombuffer(offs, np.int64),
                     np.frombuffer(ts, np.int64), names,
                     None if tindex is None else np.frombuffer(tindex, np.int32),
                     (kb, ko, kn, vb, vo, vn), None if hb is None else (hb, ho),
                     [Event(*e) for e in events])

    def assign(self, partitions: Sequence[Any]) -> None:
        """``partitions``: confluent-kafka TopicPartitions (topic, partition, offset)."""
        self._call(self._h.assign, [(tp.topic, tp.partition, tp.offset) for tp in partitions])

    def incremental_assign(self, partitions: Sequence[Any]) -> None:
        """Add ``partitions`` (TopicPartitions with their start offsets) to the assignment,
        the others keeping their positions (a followed topic's new partitions)."""
        self._call(self._h.incremental_assign,
                   [(tp.topic, tp.partition, tp.offset) for tp in partitions])

    def pause(self, partitions: Sequence[Any]) -> None:
        self._call(self._h.pause, [(tp.topic, tp.partition) for tp in partitions])

    def commit(self, offsets: Sequence[Any] | None = None, asynchronous: bool = True) -> None:
        """Commit ``offsets`` (TopicPartitions with the next offset to read). Always waits for
        the broker (kcompact commits synchronously); without offsets there is nothing to do,
        as offsets are never stored automatically here."""
        if offsets:
            self._call(self._h.commit, [(tp.topic, tp.partition, tp.offset) for tp in offsets])

    def get_watermark_offsets(self, partition: Any, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        return self._call(self._h.watermarks, partition.topic, partition.partition,
                          _ms(timeout), cached)


class NativeProducer(NativeClient):
    """A producer on kcompact's own rd_kafka_t: ``produce_columns`` and the confluent-kafka
    Producer methods restore uses (produce, poll, flush, len, list_topics and the transactional
    calls). Failed deliveries reach the configuration's ``on_delivery`` (per-call delivery
    callables are not supported); successful ones are counted by ``flush()``."""

    _KIND = 0

    def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,
                callback: Any = None, on_delivery: Any = None, timestamp: int = 0,
                headers: Any = None) -> None:
        """One record, as confluent-kafka's ``produce`` (BufferError when the queue is full)."""
        if callback is not None or on_delivery is not None:
            raise TypeError("kcompact's Kafka producer reports deliveries to the "
                            "configuration's on_delivery only")
        if isinstance(headers, dict):
            headers = list(headers.items())
        if isinstance(value, str):
            value = value.encode()
        if isinstance(key, str):
            key = key.encode()
        self._call(self._h.produce, topic, value, key, partition, timestamp or 0, headers)

    def produce_columns(self, topic: str, partition: int, partitions: np.ndarray | None,
                        keys: tuple, values: tuple, timestamps: np.ndarray,
                        headers: tuple | None = None) -> None:
        """Every record: ``keys``/``values`` are (buffer, starts, ends, nulls) with int64 starts
        and ends and uint8 nulls; ``partitions`` int32 per record, or None for ``partition``;
        ``headers`` None or (buffer, starts, ends) of each record's header section in the
        store's encoding (kcompact.reput.record.encode_headers; empty for none). The GIL is
        released meanwhile. Raises KafkaException for an error other than a full queue (which
        it waits out, serving delivery reports)."""
        done, code, reason = self._call(self._h.produce_columns, topic, partition, partitions,
                                        *keys, *values, timestamps, headers)
        if code:
            from confluent_kafka import KafkaError, KafkaException
            raise KafkaException(KafkaError(code, f"{reason} (after {done} of "
                                                  f"{len(timestamps)} records)"))

    def poll(self, timeout: float = -1) -> int:
        return self._call(self._h.poll, _ms(timeout))

    def flush(self, timeout: float = -1) -> int:
        """Wait for every queued record's delivery; the number still queued after it."""
        return self._call(self._h.flush, _ms(timeout))

    def __len__(self) -> int:
        return self._h.outq_len()

    def track_deliveries(self) -> None:
        """Count acknowledged deliveries per partition from now on (``delivered()``); the
        producer must have been made with ``delivery.report.only.error=false``. Counted in C:
        no Python call per record."""
        self._h.track_acks(True)

    def delivered(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """(topic, partition) -> (lowest offset, highest offset, count) of the deliveries
        acknowledged since the last call (call it after ``flush()``)."""
        return {(t, p): (lo, hi, n) for t, p, lo, hi, n in self._h.acks()}

    def init_transactions(self, timeout: float = -1) -> None:
        self._call(self._h.init_transactions, _ms(timeout))

    def begin_transaction(self) -> None:
        self._call(self._h.begin_transaction)

    def commit_transaction(self, timeout: float = -1) -> None:
        self._call(self._h.commit_transaction, _ms(timeout))

    def abort_transaction(self, timeout: float = -1) -> None:
        self._call(self._h.abort_transaction, _ms(timeout))
