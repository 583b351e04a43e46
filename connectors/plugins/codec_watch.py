"""The source's codec for ``compression.type=producer``: what the store sink seals each partition
of a topic with when the store's topic keeps "the source's codec" (the default of a new store).

A consumer is never told the codec of the batches it reads, so :class:`SinkCodecWatch` asks the
brokers (framework/codec_probe.py: a Fetch of a few KB, the first data batch's attributes) for
every partition of such a topic when a task opens it, before any of its records is fetched, and
again in the background every :data:`REPROBE_BYTES` of records appended to a partition (and at
its first records when it was empty), at the last offset appended. What it reads goes into
store.json (``Store.record_source_codecs``, written only when a codec changed), where every seal
and compaction of the store, in this process or another, takes it from
(``PartitionLog.source_codec``). A topic whose effective ``compression.type`` names a codec
(synced from the source, or set on the store) is recompressed to it and never probed.

When the probe cannot run (an authentication it does not speak, a broker that refuses or
answers garbage, one that cannot be reached) the topic falls back, in this order, to the codec
read before (store.json), to the source topic's own ``compression.type`` when it names a codec
(describe_configs: Kafka recompressed every batch to it), and else to no codec (records stored
uncompressed, what a store did before the probe); one line says which. The probe reads nothing
that is stored, so its failure never loses or changes a record: only the codec of the sealed
batches depends on it.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any, Callable, Mapping, TextIO

import numpy as np

from kcompact.reput.codecs import CODEC_BY_NAME, CODEC_NAMES

from ..framework.codec_probe import CodecProbeError, probe_codecs

#: appended record bytes of a partition between two probes of it
REPROBE_BYTES = 64 << 20


def _names(codecs: Mapping[int, int | None]) -> str:
    """``zstd (partitions 0-3)``, ``gzip (0), zstd (1)`` ..."""
    by: dict[str, list[int]] = {}
    for p, c in sorted(codecs.items()):
        by.setdefault("unknown" if c is None else CODEC_NAMES.get(c, str(c)), []).append(p)
    return ", ".join(f"{name} (partition{'s' if len(ps) > 1 else ''} "
                     f"{_span(ps)})" for name, ps in by.items())


def _span(ps: list[int]) -> str:
    if len(ps) > 1 and ps == list(range(ps[0], ps[-1] + 1)):
        return f"{ps[0]}-{ps[-1]}"
    return ",".join(map(str, ps))


class SinkCodecWatch:
    """The store sink's probe of its source's codecs (module docstring), shared by the tasks of
    a connector. ``probe``: the probe function (None: :func:`probe_codecs`, its signature);
    ``describe``: a topic's synced-config reader for the fallback, ``(topic) -> {key:
    value}`` (None: plugins/config_sync.describe_topics)."""

    def __init__(self, kafka_conf: Mapping[str, Any], *, out: TextIO | None = None,
                 prefix: str = "connect", reprobe_bytes: int = REPROBE_BYTES,
                 probe: Callable[..., dict[int, int | None]] | None = None,
                 describe: Callable[[str], Mapping[str, str]] | None = None,
                 timeout: float = 10.0):
        self.kafka_conf = dict(kafka_conf)
        self.out = out if out is not None else sys.stderr
        self.prefix, self.reprobe_bytes = prefix, reprobe_bytes
        self.probe, self.describe, self.timeout = probe, describe, timeout
        #: (topic, partition) -> record bytes appended since its last probe (None: unknown,
        #: probed at its first records)
        self._since: dict[tuple[str, int], int | None] = {}
        #: the topics probed (the others' batches are not counted)
        self._topics: set[str] = set()
        #: topics whose last probe failed (their line is printed once a failure streak)
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._queued: set[tuple[str, int]] = set()
        self._thread: threading.Thread | None = None

    def _say(self, msg: str, kind: str | None = None) -> None:
        print(f"{self.prefix}: " + (f"{kind}: " if kind else "") + msg, file=self.out,
              flush=True)

    @staticmethod
    def watched(store: Any, topic: str) -> bool:
        """Whether ``topic``'s sealed batches keep the source's codec (compression.type
        producer): only then is its source probed."""
        return store.topic_config(topic).compression_type == "producer"

    def opened(self, store: Any, positions: Mapping[tuple[str, int], int]) -> None:
        """A task opened these (topic, partition)s, to be mirrored from these offsets (< 0: the
        topic's beginning), before any of their records is fetched: each topic keeping the
        source's codec is probed now."""
        by_topic: dict[str, dict[int, int]] = {}
        for (t, p), off in positions.items():
            by_topic.setdefault(t, {})[p] = max(0, off)
        for topic, offs in sorted(by_topic.items()):
            if self.watched(store, topic):
                self._probe(store, topic, offs, first=True)

    def appended(self, store: Any, batch: Any) -> None:
        """The task appended ``batch`` (a RecordBatch): a partition past REPROBE_BYTES since
        its last probe, or whose codec was unknown, is probed again in the background at the
        last offset appended."""
        n = len(batch)
        topic = batch.topic
        if n == 0 or topic not in self._topics:
            return
        parts = batch.partitions
        nbytes = int(batch.keys.offs[-1]) + int(batch.values.offs[-1])
        if parts[0] == parts[-1] and (n < 3 or (parts == parts[0]).all()):
            groups = [(int(parts[0]), n, int(batch.offsets[-1]))]
        else:
            ps, idx, counts = np.unique(parts[::-1], return_index=True, return_counts=True)
            groups = [(int(p), int(c), int(batch.offsets[n - 1 - i]))
                      for p, i, c in zip(ps, idx, counts)]
        due = {}
        with self._lock:
            for p, count, last in groups:
                key = (topic, p)
                if key not in self._since:
                    continue  # (a topic not watched)
                since = self._since[key]
                if since is not None:
                    since += nbytes * count // n
                    self._since[key] = since
                if (since is None or since >= self.reprobe_bytes) and key not in self._queued:
                    due[p] = last
                    self._queued.add(key)
        if due:
            self._start()
            self._q.put((store, topic, due))

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="codec-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                store, topic, due = item
                with self._lock:
                    self._queued.difference_update((topic, p) for p in due)
                try:
                    if self.watched(store, topic):
                        self._probe(store, topic, due, first=False)
                except Exception as e:  # noqa: BLE001 - a probe never stops the mirror
                    self._say(f"topic {topic}: the source's codec was not recorded ({e}); the "
                              "next probe tries again", "warning")
            finally:
                self._q.task_done()

    def drain(self) -> None:
        """Wait for the probes queued so far (tests)."""
        if self._thread is not None:
            self._q.join()

    def stop(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(30)
            self._thread = None

    # -- one probe ------------------------------------------------------------------------------

    def _probe(self, store: Any, topic: str, offsets: Mapping[int, int], *, first: bool) -> None:
        self._topics.add(topic)
        try:
            got = (self.probe or probe_codecs)(self.kafka_conf, topic, offsets,
                                               timeout=self.timeout)
        except CodecProbeError as e:
            self._fallback(store, topic, list(offsets), str(e), first)
            return
        known = {p: c for p, c in got.items() if c is not None}
        before = {p: store.source_codec(topic, p) for p in offsets}
        changed = store.record_source_codecs(topic, known) if known else False
        with self._lock:
            for p in offsets:
                self._since[(topic, p)] = 0 if got.get(p) is not None else None
            was_failing = topic in self._failing
            self._failing.discard(topic)
        if first or changed or was_failing:
            unknown = [p for p in offsets if got.get(p) is None]
            shown = {p: (c if c is not None else before.get(p)) for p, c in got.items()}
            line = (f"topic {topic}: the source's batches are {_names(shown)}: sealed with that "
                    "codec (compression.type=producer)")
            if unknown:
                many = len(unknown) > 1
                line += (f"; partition{'s' if many else ''} {_span(sorted(unknown))} "
                         f"show{'' if many else 's'} no batch yet: read again at "
                         f"{'their' if many else 'its'} first records")
            self._say(line)

    def _fallback(self, store: Any, topic: str, partitions: list[int], why: str,
                  first: bool) -> None:
        with self._lock:
            for p in partitions:
                self._since[(topic, p)] = self._since.get((topic, p)) or 0
            quiet = topic in self._failing
            self._failing.add(topic)
        before = {p: store.source_codec(topic, p) for p in partitions}
        if all(c is not None for c in before.values()):
            if not quiet:
                self._say(f"topic {topic}: cannot read the source's batch codec ({why}); "
                          f"sealing with the codec read before: {_names(before)}", "warning")
            return
        named = self._source_config(topic) if not quiet else None
        if named is not None:
            store.record_source_codecs(topic, {p: named for p in partitions
                                               if before[p] is None})
            self._say(f"topic {topic}: cannot read the source's batch codec ({why}); sealing "
                      f"with the source topic's compression.type={CODEC_NAMES[named]}",
                      "warning")
        elif not quiet:
            self._say(f"topic {topic}: cannot read the source's batch codec ({why}); the "
                      "source topic's compression.type is producer (or unreadable): its records "
                      "are stored uncompressed (set compression.type on the store's topic, "
                      "`kcompact configs --alter`, to choose a codec)", "warning")

    def _source_config(self, topic: str) -> int | None:
        """The codec the source topic's compression.type names (None: producer, or not read)."""
        try:
            if self.describe is not None:
                values = self.describe(topic)
            else:
                from .config_sync import describe_topics
                values = describe_topics(str(self.kafka_conf.get("bootstrap.servers", "")),
                                         [topic], self.kafka_conf, self.timeout,
                                         lambda *a, **k: None).get(topic, {})
        except Exception:  # noqa: BLE001 - a fallback never stops the mirror
            return None
        return CODEC_BY_NAME.get(str(values.get("compression.type", "producer")))


__all__ = ["REPROBE_BYTES", "SinkCodecWatch"]
