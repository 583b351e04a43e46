"""The bulk build's sorted runs: the winning records' keys and values gathered from the bytes
read (compiled kernels, kernels.py), sorted in LevelDB's byte order, and written as large
WriteBatches by a thread of their own while the next batch is prepared."""

from __future__ import annotations

import queue
import threading

import numpy as np

from ...plugins.leveldb_sink import DATA, LevelDBSink
from . import kernels as KK

_D = DATA[0]


class BatchWriter:
    """Writes prepared WriteBatches in order in a background thread (LevelDB releases the GIL
    while it writes, so the next batch is prepared meanwhile)."""

    def __init__(self, sink: LevelDBSink):
        self.sink = sink
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            wb = self.q.get()
            if wb is None:
                return
            if self.error is None:
                try:
                    self.sink.write(wb)
                except BaseException as e:  # noqa: BLE001 - re-raised by submit/close
                    self.error = e

    def submit(self, wb) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(wb)

    def close(self) -> None:
        self.q.put(None)
        self.t.join()
        if self.error is not None:
            raise self.error


def records_of(block) -> tuple[list, list]:
    """Keys and values (None for a null key / a tombstone) of a block of records the partition
    reader returned (reput/reader.py RecordColumns)."""
    return block.keys.to_list(), block.values.to_list()


def bytes_list(buf: np.ndarray, offs: np.ndarray) -> list[bytes]:
    """bytes objects of buf[offs[i]:offs[i+1]] (contiguous items). Items of one width come out
    of numpy's fixed-width bytes dtype in one C loop, several times faster than slicing."""
    n = offs.shape[0] - 1
    if n <= 0:
        return []
    lens = np.diff(offs)
    width = int(lens[0])
    a, b = int(offs[0]), int(offs[-1])
    if width > 0 and bool((lens == width).all()):
        rows = buf[a:b].reshape(n, width)
        out = rows.view(f"S{width}").ravel().tolist()
        for i in np.flatnonzero(rows[:, -1] == 0).tolist():
            out[i] = rows[i].tobytes()   # numpy's S dtype drops trailing NUL bytes
        return out
    data = buf[a:b].tobytes()
    o = (offs - a).tolist()
    return [data[o[i]:o[i + 1]] for i in range(n)]


def sort_order(kbuf: np.ndarray, koffs: np.ndarray) -> np.ndarray:
    """Indices that sort the keys kbuf[koffs[i]:koffs[i+1]] in bytes order (what LevelDB uses):
    fixed-width rows (key zero-padded, then its length big-endian) sorted as big-endian 64-bit
    columns with numpy's lexsort; Python's sort for keys longer than 60 bytes."""
    n = koffs.shape[0] - 1
    if n <= 1:
        return np.arange(n)
    lens = np.diff(koffs)
    width = (int(lens.max()) + 4 + 7) // 8 * 8
    if width > 64:
        kb = kbuf.tobytes()
        starts, ends = koffs[:-1].tolist(), koffs[1:].tolist()
        return np.array(sorted(range(n), key=lambda i: kb[starts[i]:ends[i]]), np.int64)
    rows = np.empty(n * width, np.uint8)
    KK.sort_rows(kbuf, koffs, width, rows)
    cols = rows.reshape(n, width).view(">u8")
    ncol = width // 8
    # columns that are the same in every row do not change the order
    keys = [c for c in (cols[:, j].astype(np.uint64) for j in range(ncol - 1, -1, -1))
            if c.shape[0] and not (c == c[0]).all()]
    if not keys:
        return np.arange(n)
    return np.lexsort(keys)


class Run:
    """Winners' keys (with the data prefix) and values gathered for one sorted run."""

    def __init__(self, capacity: int = 1 << 20):
        self.kbuf = np.empty(capacity, np.uint8)
        self.vbuf = np.empty(capacity * 4, np.uint8)
        self.koffs = np.zeros(1 << 12, np.int64)
        self.voffs = np.zeros(1 << 12, np.int64)
        self.n = 0
        self.kpos = 0
        self.vpos = 0

    @property
    def nbytes(self) -> int:
        return self.kpos + self.vpos

    @staticmethod
    def _grow(a: np.ndarray, need: int) -> np.ndarray:
        if need <= a.shape[0]:
            return a
        b = np.empty(max(need, a.shape[0] * 2), a.dtype)
        b[: a.shape[0]] = a
        return b

    def add(self, block) -> None:
        """The keys and values of a block of winners (the reader's RecordColumns), gathered
        from where they lie in the bytes read (no intermediate copy)."""
        k, v = block.key_spans(), block.value_spans()
        kl = np.where(k.null, 0, k.lengths)
        vl = np.where(v.null, 0, v.lengths)
        m = len(block)
        self.koffs = self._grow(self.koffs, self.n + m + 1)
        self.voffs = self._grow(self.voffs, self.n + m + 1)
        self.kbuf = self._grow(self.kbuf, self.kpos + int(kl.sum()) + m)
        self.vbuf = self._grow(self.vbuf, self.vpos + int(vl.sum()))
        self.kpos = KK.gather(k.buf, k.starts, kl, _D, self.kbuf, self.kpos, self.koffs, self.n)
        self.vpos = KK.gather(v.buf, v.starts, vl, -1, self.vbuf, self.vpos, self.voffs, self.n)
        self.n += m
