"""Following an S3 store with shared uploads: new data in O(writers) requests, no LIST polling.

Spec: docs/formats/shared-upload.md, "Following a store". A reader that follows a store (the
Kafka endpoint's long-poll Fetch, ``kv build --follow``, ``replicate --follow``, ``kcompact
serve``) refreshes its partitions again and again. Without this module each refresh of each
partition listed the partition's manifests and the store's ``shared/`` (a LIST each): the
request bill of a follower grew with its partition and consumer counts.

``Follower`` is the store-level refresher, one per store per process (``follower_for``), shared
by every partition and every consumer of the process. Each ``poll`` (at most once per
``KCOMPACT_S3_FOLLOW_MS``, whoever asks) makes, for every writer it knows, one GET of the key
the writer's next journal entry will have (``shared/<writer>/journal/<seq>.json``: 404 until
the writer commits it; a hit is the entry itself, added to the process's ``Journal``), so its
cost is one request per writer per interval whatever the partition count. It learns of
writers from

* the listing of ``shared/`` when it starts (one LIST: every writer's entries),
* the writers registry ``shared/writers.json`` (one GET every ``WRITERS_S``): each writer adds
  its id there before its first commit (``register_writer``); a writer it names that the
  follower does not know yet is listed once (one LIST of that writer's journal),
* a listing of ``shared/`` again every ``RELIST_S`` (and every ``LEGACY_RELIST_S`` on a store
  without a registry: written before it, or by writers of an older kcompact), which also drops
  the entries the garbage collector deleted and catches anything a dropped request missed.

In a fleet of Kafka endpoints (replication/fleet/) one node polls for all: the others get its
``heads`` (each writer's next seq, the catalog's newest version) through the head source hook
(``s3_cache.set_head_source``) and GET only the entries and versions it has seen, never a key
it found absent; when the hook answers nothing, the follower polls S3 itself.

Polls at the follow interval are for readers at the live edge. A reader that is not there (the
Kafka endpoint's Fetch of a partition below its high watermark, a Metadata request: calls
inside ``off_edge()``) is content with a poll up to ``IDLE_POLL_S`` old while the last poll
found nothing new and no Fetch of the process waited at the live edge (``at_edge``) within
``EDGE_S``: a consumer catching up on a quiet store costs no poll per interval, and one that
reaches the high watermark brings the fast interval back at once (its Fetch waits, and the
waiting Fetch polls at the follow interval). Other readers (``kcompact serve``'s replicas,
``kv build --follow``) poll at the follow interval, as before.

A partition (``ManifestCatalog.refresh``) then re-reads its manifest only every
``KCOMPACT_S3_MANIFEST_RECHECK_S`` (one GET of its next version; a LIST only when it exists),
or at once when a read finds an object gone (a split collected under it): a split or a
compaction only moves records between objects, all of which stay readable for the grace period,
so a view of an older manifest plus the newer journal entries is complete. A partition whose
manifest is still written by per-partition uploads (no shared part, no ``split_to``) is re-read
at every refresh, as before.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from contextvars import ContextVar

from . import env as _env
from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from .backend import Backend
from .errors import ReputError
from .s3_cache import Heads, head_source

#: the writers registry is read this often (s)
WRITERS_S = 5.0
#: every writer's journals are listed again this often (s): drops collected entries, catches
#: anything missed
RELIST_S = 600.0
#: ... and this often on a store that has no writers registry (s)
LEGACY_RELIST_S = 60.0
#: at most this many entries of one writer are fetched in one poll (the rest at the next)
MAX_PER_POLL = 256
#: a reader off the live edge (``off_edge``) is content with a poll this old (s) while the last
#: poll found nothing new and no Fetch waited at the live edge within EDGE_S
IDLE_POLL_S = 5.0
#: a Fetch waiting at the live edge (``Follower.at_edge``) keeps every poll at the follow
#: interval this long (s): the longest a Kafka Fetch waits (apis/fetch.py MAX_WAIT_S)
EDGE_S = 30.0

_off_edge: ContextVar[bool] = ContextVar("kcompact_s3_follow_off_edge", default=False)


@contextmanager
def off_edge(off: bool = True):
    """The polls this thread makes inside are for a reader that is not waiting at the live
    edge (module docstring): they may reuse a poll up to ``IDLE_POLL_S`` old (``off`` False:
    they may not, inside an ``off_edge()``)."""
    token = _off_edge.set(off)
    try:
        yield
    finally:
        _off_edge.reset(token)


def follow_mode() -> str:
    """``journal`` (the default: this module) or ``list`` (every refresh lists, as before)."""
    return str(_env.value("KCOMPACT_S3_FOLLOW"))


def follow_interval_s() -> float:
    return int(_env.value("KCOMPACT_S3_FOLLOW_MS")) / 1000.0


def manifest_recheck_s() -> float:
    return float(_env.value("KCOMPACT_S3_MANIFEST_RECHECK_S"))


class Follower:
    """The store-level refresher of one store with shared uploads (module docstring)."""

    def __init__(self, fs: Backend, journal: SH.Journal):
        self.fs, self.journal = fs, journal
        self.interval_s = follow_interval_s()
        self._lock = threading.Lock()
        #: writer -> the seq its next journal entry will have (the key polled)
        self.next: dict[str, int] = {}
        self._polled_at: float | None = None
        #: when the last finished poll (through the head source, or of S3) started
        self._done_at: float | None = None
        self._listed_at: float | None = None
        self._writers_at: float | None = None
        #: whether the store has a writers registry (None: not read yet)
        self.registry: bool | None = None
        #: the head source hook: when this process's last poll of S3 itself started, and
        #: ended with every request answered; whether a request of the current one failed
        self._own_at: float | None = None
        self._good_at: float | None = None
        self._failed = False
        #: requests by kind made by polls (tests, bench): get_hit, get_miss, list, registry;
        #: polls answered by the head source (shared)
        self.stats = {"get_hit": 0, "get_miss": 0, "list": 0, "registry": 0, "polls": 0,
                      "shared": 0}
        #: when a Fetch last waited at the live edge (``at_edge``); whether the last poll found
        #: anything new (a writer's next seq or the catalog moved)
        self._edge_at: float | None = None
        self._moved = True
        self._polled_before = False

    def at_edge(self) -> None:
        """A reader waits at the live edge (a Fetch found less than its min_bytes): every
        poll keeps the follow interval for ``EDGE_S``."""
        self._edge_at = time.monotonic()

    def wake(self) -> None:
        """The next poll keeps the follow interval, as after one that found something new
        (a fleet's ring changed: partitions come to this process with readers that another
        process served, who must find at least what they read there)."""
        self._moved = True

    def max_age_s(self) -> float:
        """How old a poll this thread's reader is content with now (module docstring)."""
        if _off_edge.get() and not self._moved and (
                self._edge_at is None or time.monotonic() - self._edge_at >= EDGE_S):
            return max(self.interval_s, IDLE_POLL_S)
        return self.interval_s

    # -- the poll ------------------------------------------------------------------------------

    def poll(self, max_age_s: float | None = None, shared: bool = True) -> int:
        """Look for new journal entries unless a poll ran less than ``max_age_s`` ago (default:
        ``max_age_s()``: the follow interval, or ``IDLE_POLL_S`` off the live edge); returns the
        journal's generation (it grows with every entry added or dropped). ``shared`` False:
        poll S3 itself, not the head source (a fleet's poller answering the others)."""
        age = self.max_age_s() if max_age_s is None else max_age_s
        done = self._done_at
        if shared and done is not None and time.monotonic() - done < age:
            # a finished poll young enough: no wait behind one in flight for a reader that
            # asks less (an off-edge read behind a poll for the live edge)
            return self.generation()
        with self._lock:
            now = time.monotonic()
            last = self._polled_at if shared else self._own_at
            if last is not None and now - last < age:
                return self.generation()
            before = self._heads_now()
            try:
                self._poll(now, age, shared)
            finally:
                # (a follower's first poll finds the heads it had not seen: that is no sign
                # of a writer at work, which the next polls' finding new entries is)
                self._moved = self._heads_now() != before and self._polled_before
                self._polled_before = True
                if shared:
                    self._done_at = now
            return self.generation()

    def _heads_now(self) -> tuple:
        """What a poll moves: each writer's next seq, the catalog's newest version (not the
        journal's generation, which the partitions' own reads of listed entries move too)."""
        cat = SC.for_store(self.fs)
        latest = cat.latest if cat is not None else None
        return dict(self.next), latest.version if latest is not None else None

    def _poll(self, now: float, age: float, shared: bool) -> None:
        self._polled_at = now
        self.stats["polls"] += 1
        relist = RELIST_S if self.registry is not False else LEGACY_RELIST_S
        self._failed = False
        if self._listed_at is None or now - self._listed_at >= relist:
            self._list_all()
        if shared and self._follow_heads(age):
            return
        if self._writers_at is None or now - self._writers_at >= WRITERS_S:
            self._read_registry()
        self._own_at = now
        for writer in sorted(self.next):
            self._advance(writer)
        cat = SC.for_store(self.fs)
        if cat is not None:  # a store catalog: its next version (O(1), not per partition)
            try:
                cat.poll_next()
            except (OSError, ReputError):
                pass  # the next poll asks again
        if not self._failed:
            self._good_at = time.monotonic()

    def heads(self) -> Heads:
        """What this process's own polls found (the head source hook: a fleet's poller)."""
        with self._lock:
            cat = SC.for_store(self.fs)
            latest = cat.latest if cat is not None else None
            return Heads(dict(self.next), latest.version if latest is not None else None,
                         float("inf") if self._good_at is None
                         else time.monotonic() - self._good_at)

    def _follow_heads(self, max_age_s: float) -> bool:
        """A poll through the head source (module docstring): GET only the entries and the
        catalog versions its poll found (one up to ``max_age_s`` old); False when it has no
        answer (poll S3 then)."""
        src = head_source()
        try:
            heads = src.heads(self.fs, max_age_s) if src is not None else None
        except Exception:  # noqa: BLE001 - a hook that fails: this process polls S3 itself
            heads = None
        if heads is None:
            return False
        self.stats["shared"] += 1
        for w in sorted(set(heads.writers) - set(self.next)):  # a writer new to this process
            self.stats["list"] += 1
            try:
                seqs = self.journal.list_writer(w)
            except (OSError, ReputError):
                continue  # the next poll lists it again
            self.next[w] = 1 + max(seqs, default=-1)
        for writer in sorted(self.next):
            if heads.writers.get(writer, 0) > self.next[writer]:
                self._advance(writer, heads.writers[writer])
        cat = SC.for_store(self.fs)
        if cat is not None and heads.catalog is not None and (
                cat.latest is None or cat.latest.version < heads.catalog):
            try:
                cat.poll_next(0.0)
            except (OSError, ReputError):
                pass  # the next poll asks again
        return True

    def generation(self) -> int:
        """Grows whenever the journal or the store catalog moves."""
        cat = SC.for_store(self.fs)
        return self.journal.generation + (cat.generation << 32 if cat is not None else 0)

    def _list_all(self) -> None:
        """One LIST of ``shared/``: every writer's entries (the journal drops collected ones)."""
        self.stats["list"] += 1
        self.journal.refresh(0.0)
        self._listed_at = time.monotonic()
        for w, s in self.journal.listed_keys():
            self.next[w] = max(self.next.get(w, 0), s + 1)

    def _read_registry(self) -> None:
        self._writers_at = time.monotonic()
        self.stats["registry"] += 1
        try:
            writers = SH.read_writers(self.fs)
        except (OSError, ReputError):
            self._failed = True
            return  # the next poll tries again
        self.registry = writers is not None
        for w in sorted((writers or set()) - set(self.next)):
            self.stats["list"] += 1
            try:
                seqs = self.journal.list_writer(w)
            except (OSError, ReputError):
                self._writers_at = None  # try again at the next poll
                continue
            self.next[w] = 1 + max(seqs, default=-1)

    def _advance(self, writer: str, stop: int | None = None) -> None:
        """GET the writer's next entries, while they exist (and are below ``stop``, the head
        source's next seq); stop at the first 404 or after one recent entry (the writer's
        next commit is a flush interval away)."""
        now_ms = int(time.time() * 1000)
        for _ in range(MAX_PER_POLL):
            seq = self.next[writer]
            if stop is not None and seq >= stop:
                return
            try:
                entry = self.journal.fetch_entry(writer, seq)
            except FileNotFoundError:
                self.stats["get_miss"] += 1
                return
            except (OSError, ReputError):
                self._failed = True
                return  # a dropped request: the next poll asks again
            self.stats["get_hit"] += 1
            self.next[writer] = seq + 1
            if stop is None and entry is not None \
                    and entry.created_ms >= now_ms - 2000 * self.interval_s:
                return  # caught up: do not spend a GET on a key that cannot exist yet

    def forget_listing(self) -> None:
        """The next poll lists ``shared/`` again (a read found an entry's object gone)."""
        with self._lock:
            self._listed_at = None
            self._polled_at = None
            self._done_at = None


_FOLLOWERS: "weakref.WeakKeyDictionary[Backend, Follower]" = weakref.WeakKeyDictionary()
_FOLLOWED: "weakref.WeakSet[Backend]" = weakref.WeakSet()
_LOCK = threading.Lock()


def follow(fs: Backend) -> None:
    """The process only reads the store on ``fs`` and follows it (the Kafka endpoint, ``kcompact
    serve``, ``kv build --follow``): its partitions refresh through the follower. A process
    that also compacts or writes the store keeps re-reading each partition's manifest as it
    refreshes it (its decisions need the latest version)."""
    with _LOCK:
        _FOLLOWED.add(fs)


def follower_for(fs: Backend) -> Follower | None:
    """The store-level refresher of the store on ``fs``; None when the process does not follow
    it (``follow``), the store uses no shared uploads (as far as this process knows:
    ``shared.journal_in_use``) or KCOMPACT_S3_FOLLOW is ``list``."""
    if fs not in _FOLLOWED:
        return None
    j = SH.journal_in_use(fs)
    if j is None or follow_mode() != "journal":
        return None
    with _LOCK:
        f = _FOLLOWERS.get(fs)
        if f is None:
            f = _FOLLOWERS[fs] = Follower(fs, j)
        return f


__all__ = ["EDGE_S", "Follower", "IDLE_POLL_S", "follow", "follow_interval_s", "follow_mode",
           "follower_for", "manifest_recheck_s", "off_edge"]
