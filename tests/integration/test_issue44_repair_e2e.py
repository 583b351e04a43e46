"""Issue 44 end to end: `kcompact repair --from` a replica served by a real `kcompact serve`
process, on a local store and on S3 (SeaweedFS), `repair --salvage` on S3, and a repair
SIGKILLed on S3.

The source is a replica ``R`` of the store taken before the store got more records, so the
damaged store holds records newer than the source's. After each mutation of the store (the
unit campaign's file kinds and mutations: tests/unit/test_issue44_repair.py), `repair --from R`
must exit 0, the store must verify, and each repaired partition must hold exactly ``R``'s
records below ``R``'s next offset plus the store's own records from there on, less the offset
ranges the repair reports lost (which can only lie past ``R``'s end); a partition it did not
repair is left as it was. A default run takes a representative subset; ``-m slow`` all of it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "unit"
sys.path.insert(0, str(UNIT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_issue44_repair as U  # noqa: E402
from test_replication import Serve, free_port, kc  # noqa: E402

from kcompact.reput.config import ManualClock  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402
from kcompact.reput.store import Store, WriterOptions  # noqa: E402

pytestmark = pytest.mark.integration
TOPIC = U.TOPIC


def dump(url: str, p: int) -> dict[int, dict]:
    r = kc("dump", "--store", url, "--topic", TOPIC, "--partition", str(p), "--json")
    assert r.returncode == 0, r.stderr
    return {x["offset"]: x for x in map(json.loads, r.stdout.splitlines())}


def add_newer(url: str) -> None:
    """Records 300..339 of each partition (newer than the replica's)."""
    clock = ManualClock(10_000_000)
    with Store.open(url, writer="w", clock=clock, options=WriterOptions(seal_format=1)) as s:
        s.append(RecordBatch.from_records(TOPIC, [
            (p, i, clock.ms() + i, b"key-%d" % (i % 23), b"newer-%d" % i) for p in range(2)
            for i in range(300, 340)]))
        s.flush()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(store url with newer records, the replica's url, its served URL, token file)."""
    root = tmp_path_factory.mktemp("issue44-it")
    master = str(root / "master")
    U.build(master)
    tok = root / "token"
    tok.write_text(os.urandom(24).hex() + "\n")
    srv = Serve(master, str(tok), free_port())
    replica = str(root / "replica")
    try:
        r = kc("replicate", "--from", srv.url, "--token-file", tok, "--store", replica)
        assert r.returncode == 0, r.stderr
    finally:
        srv.stop()
    add_newer(master)
    srv = Serve(replica, str(tok), free_port())
    try:
        yield master, replica, srv.url, tok
    finally:
        srv.stop()


def check_from(url: str, replica: str, src_url: str, tok) -> dict:
    r = kc("repair", "--store", url, "--from", src_url, "--token-file", tok, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    v = kc("verify", "--store", url)
    assert v.returncode == 0, (v.stdout[-2000:], doc)
    return doc


def expected(replica: str, store0: dict[int, dict[int, dict]], p: int,
             r_next: int) -> dict[int, dict]:
    want = {o: x for o, x in dump(replica, p).items() if o < r_next}
    want.update({o: x for o, x in store0[p].items() if o >= r_next})
    return want


def compare(url: str, replica: str, store0, doc: dict, r_next: dict[int, int],
            before: dict | None) -> None:
    repaired = {e["partition"]: e for e in doc["repaired"]}
    for p in range(2):
        got = dump(url, p)
        if p not in repaired:
            assert got == store0[p], p
            if before is not None:
                assert U.partition_files(url, p) == before[p]
            continue
        e = repaired[p]
        assert e["source_next_offset"] == r_next[p] and e["records_from_source"] > 0
        want = expected(replica, store0, p, r_next[p])
        ranges = [(x["first"], x["last"]) for x in e["lost"]]
        assert all(a >= r_next[p] for a, _ in ranges), ranges  # the source covers the rest
        for off, x in got.items():
            assert want.get(off) == x, (p, off)
        missing = set(want) - set(got)
        assert missing == {o for o in want if any(a <= o and (b is None or o <= b)
                                                  for a, b in ranges)}, (p, ranges)


def _cases(every: int):
    cases = [(k, m) for k in U.LOCAL_KINDS if k not in ("commitlog", "reput.checkpoint")
             for m in U.MUTATIONS]
    return [c for i, c in enumerate(cases) if i % every == 0]


# The default run (CI's time budget) takes every 16th case of the campaign here, two on
# SeaweedFS and two kills of a repair there; the unit tier runs the whole campaign against the same code on local and in-memory
# S3 stores. KCOMPACT_FULL_CAMPAIGN=1 runs every case end to end as well (about 20 minutes).
FULL = os.environ.get("KCOMPACT_FULL_CAMPAIGN") == "1"


@pytest.mark.parametrize("kind,mutation", [
    *_cases(16),
    *[pytest.param(k, m, marks=pytest.mark.slow) for k, m in _cases(1)
      if FULL and (k, m) not in _cases(16)]])
def test_issue44_repair_from_a_served_replica(source, tmp_path, kind, mutation):
    master, replica, src_url, tok = source
    store0 = {p: dump(master, p) for p in range(2)}
    with Store.open(replica) as st:
        r_next = {p: st.next_offset(TOPIC, p) for p in range(2)}
    assert all(max(store0[p]) >= r_next[p] for p in range(2))  # the store is ahead
    url = str(tmp_path / "store")
    shutil.copytree(master, url)
    damaged = U.mutate_local(url, kind, mutation, 0)
    before = {p: U.partition_files(url, p) for p in range(2)}
    doc = check_from(url, replica, src_url, tok)
    if kind != "store.json" and damaged is not None:
        assert {e["partition"] for e in doc["repaired"]} <= {damaged}
    compare(url, replica, store0, doc, r_next, before)


@pytest.mark.parametrize("a,b,mutation", [("segments.json", "log2", "delete"),
                                           ("forge", "log1", "delete")])
def test_issue51_a_double_fault_is_repaired_from_a_served_replica(source, tmp_path, a, b,
                                                                  mutation):
    """The segment list and a segment lost together (or a forged list): found by verify
    through the partition's ledger, repaired from the replica with nothing lost below its
    end."""
    master, replica, src_url, tok = source
    store0 = {p: dump(master, p) for p in range(2)}
    with Store.open(replica) as st:
        r_next = {p: st.next_offset(TOPIC, p) for p in range(2)}
    url = str(tmp_path / "store")
    shutil.copytree(master, url)
    U._mutate_pair(url, a, b, mutation)
    assert kc("verify", "--store", url).returncode == 1
    doc = check_from(url, replica, src_url, tok)
    assert [e["partition"] for e in doc["repaired"]] == [0]
    compare(url, replica, store0, doc, r_next, None)
    assert not os.path.exists(os.path.join(url, "partitions", TOPIC, "0", "damage.json"))


def test_issue44_repair_from_refuses_a_partition_the_source_does_not_serve(source, tmp_path):
    master, replica, src_url, tok = source
    url = str(tmp_path / "store")
    shutil.copytree(master, url)
    with Store.open(url, writer="w") as s:  # a topic the replica does not have
        s.append(RecordBatch.from_records("other", [(0, 0, 1, b"k", b"v")]))
        s.flush()
    r = kc("repair", "--store", url, "--from", src_url, "--token-file", tok, "--topic",
           "other", "--partition", "0")
    assert r.returncode == 1 and not os.path.exists(os.path.join(url, "quarantine"))
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert "other-0 cannot be repaired from" in line and "nothing was changed" in line


# -- S3 (SeaweedFS) --------------------------------------------------------------------------


def _s3_mutate(s3_store_url, url: str, kind: str, mutation: str, seed: int) -> int | None:
    """The unit campaign's mutation, on the bucket's objects through the S3 API."""
    client = s3_store_url.server.client()
    bucket, prefix = url[len("s3://"):].split("/", 1)

    class _Fake:  # (the unit helpers take the in-memory S3's shape)
        objects = {bucket: {}}
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix + "/") for o in page.get("Contents", [])]
    for k in keys:
        if "/manifest/" in k or k.endswith((".log", ".bcq", "store.json")):
            _Fake.objects[bucket][k] = (client.get_object(Bucket=bucket, Key=k)["Body"].read(),
                                        None)
    rnd = random.Random(f"s3/{kind}/{mutation}/{seed}")
    key, p = rnd.choice(U.s3_objects(_Fake, url)[kind])
    new = U.mutate_bytes(_Fake.objects[bucket][key][0], mutation, rnd)
    if new is None:
        client.delete_object(Bucket=bucket, Key=key)
    else:
        client.put_object(Bucket=bucket, Key=key, Body=new)
    return p


S3_CASES = [("log2", "flip"), ("store.json", "truncate"),
            *([("bcq2", "zero4k"), ("log1", "truncate"), ("bcq1", "delete"),
               ("manifest", "flip"), ("log1", "delete")] if FULL else [])]


@pytest.mark.parametrize("kind,mutation", S3_CASES)
def test_issue44_repair_on_seaweedfs(source, s3_store_url, tmp_path, kind, mutation):
    """On real S3: the store built there and mutated through the S3 API; `compact --force`
    on one copy, `repair --salvage` on another, `repair --from` the replica on a third."""
    master, replica, src_url, tok = source

    def damaged_store() -> tuple[str, dict, int | None]:
        url = s3_store_url()
        Store.create(url).close()  # per-partition uploads: the segment objects it damages
        U.build(url)
        add_newer(url)
        store0 = {p: dump(url, p) for p in range(2)}
        return url, store0, _s3_mutate(s3_store_url, url, kind, mutation, 0)

    url, store0, damaged = damaged_store()
    r = kc("compact", "--store", url, "--force", "--json")
    if r.returncode and kind != "store.json":
        res = {x["partition"]: x for x in json.loads(r.stdout)["partitions"]}
        assert res[damaged]["damaged"] and not res[1 - damaged]["damaged"], res
        assert not res[1 - damaged]["skipped"]

    url, store0, damaged = damaged_store()
    r = kc("repair", "--store", url, "--salvage", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert kc("verify", "--store", url).returncode == 0
    for p in range(2):
        got = dump(url, p)
        ranges = [(x["first"], x["last"]) for e in doc["repaired"] if e["partition"] == p
                  for x in e["lost"]]
        for off, x in got.items():
            assert x == store0[p][off], (p, off)
        missing = set(store0[p]) - set(got)
        assert missing == {o for o in store0[p] if any(
            a <= o and (b is None or o <= b) for a, b in ranges)}, (p, ranges)

    url, store0, damaged = damaged_store()
    with Store.open(replica) as st:
        r_next = {p: st.next_offset(TOPIC, p) for p in range(2)}
    doc = check_from(url, replica, src_url, tok)
    compare(url, replica, store0, doc, r_next, None)


def test_issue44_sigkill_during_a_repair_on_seaweedfs(s3_store_url, tmp_path):
    """The manifest commit is the swap: a repair killed at any moment leaves the partition as
    it was (verify lists the same problems) or repaired (verify passes); a repair run again
    then ends repaired."""
    kcompact = str(Path(sys.executable).parent / "kcompact")
    for k in range(5 if FULL else 2):
        url = s3_store_url()
        Store.create(url).close()  # per-partition uploads, as the campaign above
        U.build(url)
        _s3_mutate(s3_store_url, url, "log1", "flip", 0)
        before = kc("verify", "--store", url)
        assert before.returncode == 1
        p = subprocess.Popen([kcompact, "repair", "--store", url, "--salvage"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0 + 0.6 * k)
        p.send_signal(signal.SIGKILL)
        p.wait()
        v = kc("verify", "--store", url)
        assert v.returncode == 0 or v.stdout == before.stdout, v.stdout
        r = kc("repair", "--store", url, "--salvage")
        assert r.returncode == 0, r.stderr
        assert kc("verify", "--store", url).returncode == 0


# -- a mirror keeps mirroring the other partitions ------------------------------------------------


@pytest.mark.parametrize("engine", ["local", "spark"])
def test_issue44_a_mirror_goes_on_with_the_partitions_that_are_not_damaged(
        kafka_bootstrap, make_topic, tmp_path, engine):
    """A store whose partition 1 is damaged (a sealed .log cut short): `mirror` copies the
    other partitions, names partition 1 in one warning and in its final error (exit 1), and
    fetched nothing of it; after `repair --salvage`, the next mirror completes it."""
    from test_mirror import kcompact, produce

    topic = make_topic(partitions=3)
    produce(kafka_bootstrap, topic, [(i % 3, b"k%d" % (i % 40), b"v%d" % i * 20, None,
                                      1_700_000_000_000 + i) for i in range(1500)])
    store = tmp_path / "store"
    with Store.open(str(store), create=True) as st:  # (a local override: several segments)
        st.set_topic_config(topic, {"segment.bytes": 16384})
    # (the mirrors around the one under test run locally: the engine is that one's parameter)
    r = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store",
                 str(store), "--engine", "local")
    assert r.returncode == 0, r.stderr
    produce(kafka_bootstrap, topic, [(i % 3, b"k%d" % (i % 40), b"w%d" % i * 20, None,
                                      1_700_000_100_000 + i) for i in range(1500)])
    # partition 1's first .log cut short: the partition no longer opens for write
    d = store / "partitions" / topic / "1"
    log = sorted(p for p in d.iterdir() if p.suffix == ".log")[0]
    os.truncate(log, log.stat().st_size - 10)
    with Store.open(str(store)) as st:
        before = {p: st.partition(topic, p).next_offset for p in (0, 2)}
    r = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store",
                 str(store), "--engine", engine, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    warn = [ln for ln in lines if f"{topic}-1 is not mirrored" in ln]
    assert len(warn) == 1 and log.name in warn[0], r.stderr
    assert lines[-1].startswith(f"kcompact: error: {topic}-1 was not mirrored"), lines[-1]
    with Store.open(str(store)) as st:
        for p in (0, 2):  # the others got the new records
            assert st.partition(topic, p).next_offset == before[p] + 500
    assert kcompact("repair", "--store", str(store), "--salvage").returncode == 0
    r = kcompact("mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--store",
                 str(store), "--engine", "local")
    assert r.returncode == 0, r.stderr
    with Store.open(str(store)) as st:
        assert st.partition(topic, 1).next_offset == 1000
    assert kcompact("verify", "--store", str(store)).returncode == 0
