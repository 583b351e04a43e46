"""A store's upkeep of its store catalog and its shared objects (an object store): folding this
writer's journal entries into the catalog, reconciling the catalog with the partitions'
manifests, and the garbage collections that follow (docs/formats/store-catalog.md,
docs/formats/shared-upload.md).

One job of ``Store`` (reput/store.py; docs/architecture.md, "The rooms of the storage layer"),
which keeps a method for each of these that delegates here. On a local store, or an S3 store
without a catalog, every step is a no-op.
"""

from __future__ import annotations

import threading
from typing import Any

from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from .errors import ReputError


class CatalogUpkeep:
    """The store catalog's upkeep for ``store`` (its backend, writer and publisher)."""

    def __init__(self, store: Any):
        self.store = store
        #: guards ``unfolded`` (the writer's flush adds to it, a background fold takes from it)
        self._mu = threading.Lock()
        #: this writer's journal entries not yet folded into the store catalog (at open: those
        #: a killed process of this writer committed and never folded)
        self.unfolded: list = self.left_unfolded() if store.shared_uploads else []
        #: the fold under way in a thread of its own (``WriterOptions(fold="background")``)
        self._folding: threading.Thread | None = None
        self.stats = {"folds": 0, "background": 0, "failed": 0}

    def _catalog(self):
        return self.store.publisher.store_catalog()

    def left_unfolded(self) -> list:
        """``Store.left_unfolded``."""
        st = self.store
        cat = self._catalog()
        j = SH.journal_for(st.fs)
        if cat is None or cat.latest is None or j is None or st.writer is None:
            return []
        folded = cat.latest.folded.get(st.writer, -1)
        out = []
        for w, seq in j.listed_keys():
            if w == st.writer and seq > folded:
                try:
                    e = j.fetch_entry(w, seq)
                except FileNotFoundError:
                    continue
                if e is not None:
                    out.append(e)
        return out

    def shared_committed(self, entry) -> None:
        """``Store.shared_committed``: every ``fold_every()`` entries, a fold, by this flush
        or (``WriterOptions(fold="background")``) by a thread of its own, started here unless
        one is under way (the next entry starts the next)."""
        if SC.for_store(self.store.fs) is None:
            return
        with self._mu:
            self.unfolded.append(entry)
            due = len(self.unfolded) >= SC.fold_every()
        if not due:
            return
        if getattr(self.store.options, "fold", "flush") != "background":
            self.fold()
            return
        t = self._folding
        if t is not None and t.is_alive():
            return
        self._folding = threading.Thread(target=self._fold_once, args=(True,),
                                         name="kcompact-catalog-fold", daemon=True)
        self._folding.start()

    def fold(self) -> None:
        """``Store.fold_catalog``: after the background fold under way, if any, every entry
        still unfolded. Not a commit point: a failure is retried at the next fold."""
        t = self._folding
        if t is not None and t is not threading.current_thread():
            t.join()
        self._fold_once(False)

    def _fold_once(self, background: bool) -> None:
        """One catalog commit folding the entries unfolded when it starts (one PUT; a lost race
        a LIST and a GET more); entries committed meanwhile wait for the next."""
        cat = self._catalog()
        with self._mu:
            todo = list(self.unfolded)
        if cat is None or not todo:
            return
        try:
            cat.fold(self.store.writer or "writer", todo)
        except (OSError, ReputError) if not background else Exception:
            # (the entries stay readable from their keys; the next fold retries: a thread's
            # failure of any kind too, never raised into the writer)
            self.stats["failed"] += 1
            return
        self.stats["folds"] += 1
        self.stats["background"] += background
        done = {id(e) for e in todo}
        with self._mu:
            self.unfolded = [e for e in self.unfolded if id(e) not in done]

    def reconcile(self):
        """A store catalog: record every partition manifest newer than the catalog's (each
        read itself: a committer killed between its manifest commit and the catalog's), so
        nothing the newest catalog lists is deleted by the collector that follows
        (docs/formats/store-catalog.md, "Lagging"). Returns the catalog (None: no catalog)."""
        cat = self._catalog()
        if cat is None:
            return None
        from . import manifest as M
        fs = self.store.fs
        listed = [(t, int(p)) for t in fs.listdir(fn.PARTITIONS_DIR)
                  for p in fs.listdir(fn.topic_dir(t)) if p.isdigit()]
        cat.reconcile(lambda t, p: M.read_latest(fs, fn.partition_dir(t, p)), also=listed)
        return cat

    def collect_shared_garbage(self) -> list[str]:
        """``Store.collect_shared_garbage``."""
        fs = self.store.fs
        gone = []
        cat = self.reconcile()
        if cat is not None:
            gone += cat.collect_garbage(grace_ms=int(getattr(fs, "grace_ms", 0)),
                                        now_ms=fs.clock_ms())
        return gone + self.store.publisher.collect_shared_garbage()

    def collect_compaction_garbage(self) -> list[str]:
        """``Store.collect_compaction_garbage``."""
        self.reconcile()
        return self.store.publisher.collect_compaction_garbage()
