"""A store's recovery: what a writer's open does with the commit log it takes, and the taking
over of commit logs dead writers left.

One job of ``Store`` (reput/store.py; docs/architecture.md, "The rooms of the storage layer").
A writer's open (``recover_on_open``, from ``Store.__init__``) starts reput at the commit log's
checkpoint (the commit log truncated its torn tail when it opened), re-dispatches what follows
(idempotent: offsets at or below a partition's last indexed offset are skipped, each partition
recovered as it is opened for write), has the publisher take over local segments a dead writer
left, and flushes. ``recover_writers`` does that for every other writer's commit log no live
process holds. A partition's own recovery (a torn segment, an index behind its log) is
reput/partition_recovery.py's.
"""

from __future__ import annotations

from typing import Any

from . import filenames as fn


def recover_on_open(store: Any) -> None:
    """A writer's open, after its commit log and reput are made: dispatch from the checkpoint
    and flush. On failure the commit-log and partition locks are released (the caller may fix
    the cause, which the error names, and open the store again from this same process)."""
    cl, reput = store.commitlog, store.reput
    assert cl is not None and reput is not None
    try:
        reput.position = cl.read_checkpoint()
        if cl.segments and reput.position > cl.end:
            # The commit log lost its tail below the checkpoint (fsync=never and a power cut,
            # or a corrupt record cut by recovery). Those records were dispatched; new appends
            # start at the end, so dispatch continues there.
            reput.position = cl.end
        store.dispatch()
        store.publisher.take_over_local_segments()
        store.flush()
    except BaseException:
        try:
            store.registry.abandon()
        finally:
            cl.close()
            store.writes.commitlog = None
        raise


def recover_writers(store: Any) -> list[str]:
    """Re-dispatch every other writer's commit log that no live process holds
    (``Store.recover_writers``). Returns the writers recovered."""
    from .errors import StoreLockedError
    done = []
    for w in store.commitlog_fs.listdir(fn.COMMITLOG_DIR):
        if w == store.writer:
            continue
        try:
            # (the store's own class: no import of reput/store.py, which imports this module)
            other = type(store)(store.fs, store.meta, writer=w, options=store.options,
                                clock=store.clock, commitlog_fs=store.commitlog_fs)
        except StoreLockedError:
            continue
        other.close()
        done.append(w)
    store.registry.close_views()
    return done
