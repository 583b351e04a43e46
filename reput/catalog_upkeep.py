"""A store's upkeep of its store catalog and its shared objects (an object store): folding this
writer's journal entries into the catalog, reconciling the catalog with the partitions'
manifests, and the garbage collections that follow (docs/formats/store-catalog.md,
docs/formats/shared-upload.md).

One job of ``Store`` (reput/store.py; docs/architecture.md, "The rooms of the storage layer"),
which keeps a method for each of these that delegates here. On a local store, or an S3 store
without a catalog, every step is a no-op.
"""

from __future__ import annotations

from typing import Any

from . import filenames as fn
from . import shared as SH
from . import store_catalog as SC
from .errors import ReputError


class CatalogUpkeep:
    """The store catalog's upkeep for ``store`` (its backend, writer and publisher)."""

    def __init__(self, store: Any):
        self.store = store
        #: this writer's journal entries not yet folded into the store catalog (at open: those
        #: a killed process of this writer committed and never folded)
        self.unfolded: list = self.left_unfolded() if store.shared_uploads else []

    def _catalog(self):
        fs = self.store.fs
        return SC.for_store(fs) if not fs.appendable else None

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
        """``Store.shared_committed``."""
        if SC.for_store(self.store.fs) is None:
            return
        self.unfolded.append(entry)
        if len(self.unfolded) >= SC.fold_every():
            self.fold()

    def fold(self) -> None:
        """``Store.fold_catalog``: not a commit point, a failure is retried at the next fold."""
        cat = self._catalog()
        if cat is None or not self.unfolded:
            return
        try:
            cat.fold(self.store.writer or "writer", self.unfolded)
        except (OSError, ReputError):
            return  # (the entries stay readable from their keys; the next fold retries)
        self.unfolded = []

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
