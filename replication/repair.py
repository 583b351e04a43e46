"""`kcompact repair`: make a store whose `kcompact verify` fails whole again, partition by partition.

Two ways (docs/operations-damage.md):

* ``--from URL --token-file F``: each damaged partition is pulled again from a serving master or
  replica (``Replicator.pull_into``: replication protocol 2's stored segments where the source
  speaks it, records otherwise), from offset 0 to the source's next offset; the local records
  past that offset that still verify (reput/salvage.py) are kept after them, so a replica that
  was behind loses nothing it had. The source's compaction horizon comes along.
* ``--salvage`` (no replica): each damaged partition is rebuilt from its own records that still
  verify (reput/salvage.py); what is lost is printed as offset ranges per partition.

Either way the repaired partition is built apart, checked whole (``verify``), put in place
crash-safely and the damaged files kept in ``quarantine/<run>/`` with a report
(reput/quarantine.py, docs/formats/quarantine.md); then the partition is verified again where
it lies. Which partitions: those named (``--topic T --partition P``), else every partition in
which ``verify`` (of the store, or of ``--topic``) finds a problem. A partition another process
writes is refused (stop the mirror first). Commit-log damage is not a partition's: ``--salvage``
also sets aside damaged commit-log segments whose records were dispatched (``commitlog``).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass

import numpy as np

from kcompact.reput import filenames as fn
from kcompact.reput.backend import LocalBackend
from kcompact.reput.config import SYSTEM_CLOCK
from kcompact.reput.errors import CorruptRecordError, ReputError
from kcompact.reput import damage_record as DR
from kcompact.reput.quarantine import RepairError, RepairRun
from kcompact.reput.repair_kinds import repair_kind_for
from kcompact.reput.salvage import Salvaged, salvage_partition
from kcompact.reput.salvage_store import (commitlogs_damaged, rebuild_store_json,
                                          salvage_commitlogs)
from kcompact.reput.store import Store, backend_for, default_commitlog_dir
from kcompact.reput.verify import VerifyReport, verify_partition, verify_store

from .client import MasterClient, check_master_url, unavailable_partitions
from .errors import ReplicationError
from .progress import Progress
from .protocol import read_token_file
from .replica import ReplicaOptions, Replicator

_PARTITION_IN = re.compile(r"(?:^|/)partitions/([A-Za-z0-9._-]{1,249})/(\d+)(?:/|$)")


@dataclass(frozen=True)
class RepairOptions:
    """``kcompact repair``'s options."""

    store: str
    from_url: str | None = None
    token_file: str | None = None
    topic: str | None = None
    partition: int | None = None
    salvage: bool = False
    json: bool = False


def damaged_partitions(report: VerifyReport) -> list[tuple[str, int]]:
    """The partitions ``verify`` names a problem in (by the paths of its problems)."""
    out: list[tuple[str, int]] = []
    for p in report.problems:
        m = _PARTITION_IN.search(p.path or "")
        if m and (m.group(1), int(m.group(2))) not in out:
            out.append((m.group(1), int(m.group(2))))
    return out


def _targets(store: Store, opts: RepairOptions, say) -> list[tuple[str, int]]:
    if opts.topic is not None and opts.topic not in store.topics():
        raise RepairError(f"topic {opts.topic!r} is not in store {store.url}")
    if opts.partition is not None:
        if opts.partition not in store.partitions(opts.topic):
            raise RepairError(f"{opts.topic}-{opts.partition} is not in store {store.url}")
        return [(opts.topic, opts.partition)]
    say("verifying the store to find the damaged partitions")
    report = verify_store(store, opts.topic, found_by="repair")
    found = damaged_partitions(report)
    for t in ([opts.topic] if opts.topic else store.topics()):
        for p in store.partitions(t):
            rec = DR.read(store.fs, t, p)
            if rec is not None and (t, p) not in found and DR.clear(store.fs, t, p):
                # recorded damage that is gone (compacted away): the partition verifies whole
                say(f"{t}-{p}: verifies whole; its damage record ({rec['reason']}) is cleared")
    return found


def _sink_into(log, at_least: int = 0):
    """A salvage sink appending to ``log`` the records with offsets >= ``at_least``."""
    def sink(buf: np.ndarray, s) -> None:
        n = len(s)
        lo = int(np.searchsorted(s.offsets[:n], at_least)) if at_least else 0
        if lo < n:
            log.append(buf, s, lo, n)
    return sink


def _check_staged(store: Store, run: RepairRun, topic: str, partition: int) -> None:
    """The repaired partition, where it was built, verifies whole (else nothing is installed)."""
    view = Store(run.stage_fs, store.meta, writer=None, options=store.options, clock=store.clock)
    rep = VerifyReport()
    verify_partition(view, topic, partition, rep, found_by=None)
    if rep.problems:
        raise RepairError(f"the repaired {topic}-{partition} does not verify ({rep.problems[0]});"
                          " nothing was changed: report this")


def _verify_in_place(store: Store, topic: str, partition: int) -> None:
    store.release_partition(topic, partition)
    rep = VerifyReport()
    verify_partition(store, topic, partition, rep, found_by="repair")
    if rep.problems:
        raise RepairError(f"{topic}-{partition} was repaired but does not verify: "
                          f"{rep.problems[0]}; run `kcompact verify`")
    # repaired: its damage record goes (a local swap moved it to quarantine with the damaged
    # files; an object store's record is a key of its own: reput/damage_record.py)
    DR.clear(store.fs, topic, partition)


def _salvage_one(store: Store, run: RepairRun, topic: str, partition: int, say) -> dict:
    staged = run.stage(topic, partition, store.secret, store.topic_config(topic))
    try:
        got = salvage_partition(store.fs, topic, partition, store.secret,
                                _sink_into(staged.log),
                                local_fs=store.local_fs)
    except BaseException:
        staged.log.close(publish=False)
        raise
    entry = _entry(topic, partition, "salvage", got)
    entry["lost"] = [x.to_dict() for x in got.losses]
    staged.log.sync()
    _check_staged(store, run, topic, partition)
    run.install(staged, entry, next_offset=got.next_offset, split_to=got.split_to)
    _verify_in_place(store, topic, partition)
    say(f"{topic}-{partition}: salvaged {got.kept:,} records"
        + (f"; lost {_lost_text(got)}" if got.losses else "; nothing lost"))
    return entry


def _entry(topic: str, partition: int, mode: str, got: Salvaged) -> dict:
    return {"topic": topic, "partition": partition, "mode": mode,
            "damage": [d.to_dict() for d in got.damage[:100]],
            "damage_count": len(got.damage),
            "files": sorted({path for _, path in got.files}),
            "old_compaction_horizon": got.old_horizon,
            "records_kept_local": got.kept, "next_offset": got.next_offset}


def _lost_text(got: Salvaged) -> str:
    parts = [x.text() for x in got.losses[:5]]
    more = f" (and {len(got.losses) - 5} more ranges)" if len(got.losses) > 5 else ""
    return "; ".join(parts) + more


async def _from_one(store: Store, run: RepairRun, rep: Replicator, topic: str,
                    partition: int, info: dict, say) -> dict:
    staged = run.stage(topic, partition, store.secret, store.topic_config(topic))
    loop = asyncio.get_running_loop()
    try:
        res = await rep.pull_into(staged.log, topic, partition, info)
        target = int(info["next_offset"])
        # the local records past what the source has, those that verify, after its own
        got = await loop.run_in_executor(None, lambda: salvage_partition(
            store.fs, topic, partition, store.secret, _sink_into(staged.log, target),
            local_fs=store.local_fs))
    except BaseException:
        staged.log.close(publish=False)
        raise
    run.stage_fs.remove_tree(f"{fn.replicating_dir(topic, partition)}")
    newer = 0 if got.last_kept < target else _count_from(target, staged.log)
    entry = _entry(topic, partition, "from", got)
    entry.update(source=rep.client.url, source_store_id=rep.client.store_id,
                 records_from_source=res.records, source_next_offset=target,
                 records_kept_local=newer, protocol=rep.protocol,
                 lost=[x.to_dict() for x in got.losses
                       if x.last is None or x.last >= target])
    for x in entry["lost"]:
        x["first"] = max(x["first"], target)
    staged.log.sync()
    await loop.run_in_executor(None, _check_staged, store, run, topic, partition)
    nxt = max(target, got.next_offset) if got.last_kept >= target else target
    await loop.run_in_executor(None, lambda: run.install(
        staged, entry, next_offset=nxt,
        cleaned_offset=int(info.get("compaction_horizon", -1))))
    await loop.run_in_executor(None, _verify_in_place, store, topic, partition)
    say(f"{topic}-{partition}: {res.records:,} records from {rep.client.url} (offsets below "
        f"{target:,}, protocol {rep.protocol}), {newer:,} newer local records kept"
        + (f"; lost {len(entry['lost'])} ranges past the source's end" if entry["lost"] else ""))
    return entry


def _count_from(target: int, log) -> int:
    """Records of the repaired log at or past ``target`` (the local ones kept)."""
    n = 0
    for seg in log.segments:
        e = seg.entries()
        n += int(np.count_nonzero(e["offset"] >= target)) if e.shape[0] else 0
    return n


async def _repair_from(store: Store, opts: RepairOptions, targets, token: bytes, say,
                       progress: Progress, run_of) -> list[dict]:
    async with MasterClient(opts.from_url, token, retry_s=60.0) as client:
        doc = await client.store_doc()
        if doc.get("store_id") == store.meta.store_id:
            raise ReplicationError(f"{opts.from_url} serves this very store ({store.url}); "
                                   "repair from another replica, or use --salvage")
        served = {(t["topic"], int(p["partition"])): p for t in doc.get("topics", [])
                  for p in t.get("partitions", [])}
        unserved = {(t, p): why for t, p, why in unavailable_partitions(doc)}
        for key in targets:
            if key not in served:
                why = unserved.get(key, "the source does not hold it")
                raise ReplicationError(f"{key[0]}-{key[1]} cannot be repaired from "
                                       f"{client.url}: {why}; nothing was changed (use "
                                       "another source, or --salvage)")
        rep = Replicator(client, store, ReplicaOptions.from_env(), progress)
        rep.use_document(doc, "repair")
        run = run_of()
        run.report.update(source=client.url, source_store_id=client.store_id)
        rep.fs = run.stage_fs  # the pulls land in the run's staging
        entries = []
        try:
            for t, p in targets:
                run.hold(t, p)
                entries.append(await _from_one(store, run, rep, t, p, served[(t, p)], say))
        finally:
            rep.close()
        return entries


def _repair_salvage(store: Store, targets, say, run_of) -> list[dict]:
    run = run_of()
    entries = []
    for t, p in targets:
        run.hold(t, p)
        entries.append(_salvage_one(store, run, t, p, say))
    return entries


class _Runs:
    """The run of this repair, made when something is to be repaired (so a store with nothing
    to repair gets no quarantine directory)."""

    def __init__(self, fs, local_fs, clock, mode: str):
        self.fs, self.local_fs, self.clock, self.mode = fs, local_fs, clock, mode
        self.run: RepairRun | None = None

    def __call__(self) -> RepairRun:
        if self.run is None:
            self.run = RepairRun(self.fs, self.local_fs, self.clock,
                                 report={"store": self.fs.url, "mode": self.mode,
                                         "source": None, "store_json": None,
                                         "commitlog": []})
        return self.run

    def close(self) -> None:
        if self.run is not None:
            self.run.close()


def _open_or_rebuild(opts: RepairOptions, runs_of, say) -> tuple[Store, dict | None]:
    """The store opened; a store.json that does not read rebuilt first (reput/salvage_store.py),
    the damaged one kept in quarantine. Returns (store, what was done to store.json)."""
    fs = backend_for(opts.store)
    got = rebuild_store_json(fs, SYSTEM_CLOCK.ms())
    if got is None:
        return Store.open(opts.store, fs=fs), None
    meta, notes = got
    local_fs = repair_kind_for(fs).local_fs(fs, meta.store_id, default_commitlog_dir)
    runs = runs_of(fs, local_fs)
    run = runs()
    had = fs.exists(fn.STORE_JSON)
    where = run.keep_copy(fs, fn.STORE_JSON) if had else None
    fs.write_atomic(fn.STORE_JSON, meta.to_json())
    entry = {"file": fn.STORE_JSON, "quarantine": where, "notes": notes,
             "store_id": meta.store_id}
    run.report["store_json"] = entry
    run.write_report()
    for n in notes:
        say(f"store.json: {n}")
    return Store.open(opts.store, fs=fs), entry


def repair(opts: RepairOptions) -> int:
    """`kcompact repair --store URL (--from URL --token-file F | --salvage) [--topic T]
    [--partition P] [--json]`: 0 when every damaged partition was repaired and verifies."""
    if bool(opts.from_url) == bool(opts.salvage):
        raise ReplicationError("repair needs --from URL --token-file F (a serving master or "
                               "replica) or --salvage (keep what verifies), one of the two")
    if opts.partition is not None and opts.topic is None:
        raise ReplicationError("--partition needs --topic")
    token = None
    if opts.from_url:
        check_master_url(opts.from_url)
        if not opts.token_file:
            raise ReplicationError("--from needs --token-file (the token the source serves "
                                   "with)")
        token = read_token_file(opts.token_file)
    progress = Progress()
    mode = "from" if opts.from_url else "salvage"

    def say(text: str) -> None:
        progress.note("repair", text)

    t0 = time.monotonic()
    holder: list[_Runs] = []

    def runs_of(fs, local_fs) -> _Runs:
        if not holder:
            holder.append(_Runs(fs, local_fs, SYSTEM_CLOCK, mode))
        return holder[0]

    store = None
    entries: list[dict] = []
    commitlog: list[dict] = []
    try:
        store, store_json = _open_or_rebuild(opts, runs_of, say)
        runs = runs_of(store.fs, store.local_fs)
        runs.clock = store.clock
        if commitlogs_damaged(store.commitlog_fs):
            run = runs()
            commitlog = salvage_commitlogs(store.commitlog_fs, run.set_aside, run.keep_copy)
            run.report["commitlog"] = commitlog
            run.write_report()
            for c in commitlog:
                say(f"{c['file']}: {c['what']}")
        targets = _targets(store, opts, say)
        if targets:
            say(f"repairing {len(targets)} partitions: "
                + ", ".join(f"{t}-{p}" for t, p in targets[:10])
                + (" ..." if len(targets) > 10 else ""))
            if opts.from_url:
                entries = asyncio.run(_repair_from(store, opts, targets, token, say, progress,
                                                   runs))
            else:
                entries = _repair_salvage(store, targets, say, runs)
        run = runs.run
        if run is not None:
            run.report["store_id"] = store.meta.store_id
            run.write_report()
    except (CorruptRecordError, ReputError) as e:
        if isinstance(e, RepairError):
            raise
        raise RepairError(f"repair stopped: {e}") from None
    finally:
        try:
            if holder:
                holder[0].close()
        finally:
            if store is not None:
                store.close()
            progress.close()
    run = holder[0].run if holder else None
    qdir = f"{fn.QUARANTINE_DIR}/{run.run}" if run is not None else None
    doc = {"store": opts.store, "mode": mode, "repaired": entries, "store_json": store_json,
           "commitlog": commitlog, "quarantine": qdir,
           "report": f"{qdir}/report.json" if qdir else None}
    if opts.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if run is None:
        print(f"nothing to repair: verify finds no damage in {opts.store}")
        return 0
    if store_json is not None:
        print(f"store.json: rebuilt; " + "; ".join(store_json["notes"]))
    for c in commitlog:
        print(f"{c['file']}: {c['what']}")
    for e in entries:
        lost = e.get("lost") or []
        what = (f"{e['records_from_source']:,} records from {e['source']}, "
                f"{e['records_kept_local']:,} newer local records kept"
                if e["mode"] == "from" else f"{e['records_kept_local']:,} records kept")
        print(f"{e['topic']}-{e['partition']}: repaired: {what}; "
              + (f"lost {len(lost)} offset ranges:" if lost else "nothing lost"))
        for x in lost:
            rng = (f"{x['first']}..{x['last']}" if x["last"] is not None
                   else f"{x['first']}..(end)")
            n = f"{x['records']} records" if x["records"] is not None else "records"
            print(f"  lost offsets {rng} ({n}): {x['path']}: {x['reason']}")
    print(f"repaired {len(entries)} partitions of {opts.store} in {time.monotonic() - t0:.1f}s; "
          f"they verify; the damaged files are in {qdir}/ (report: {qdir}/report.json)")
    return 0


__all__ = ["RepairOptions", "damaged_partitions", "repair"]
