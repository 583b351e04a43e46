"""Keys with colliding MD5 must stay two keys (the digest is keyed SipHash-2-4-128).

Kafka's cleaner (SkimpyOffsetMap) and RocketMQ's compaction key their offset maps by plain MD5
of the key, so two keys crafted to share an MD5 are one key to them and compaction drops a live
record of one of them. Here the published collision pairs are used as record keys:

* Wang & Yu's 2004 pair (two 128-byte messages, "How to Break MD5 and Other Hash Functions",
  EUROCRYPT 2005), the one reproduced in most MD5-collision write-ups;
* Marc Stevens' 64-byte single-block collision (2012, MD5 = 008ee33a9d58b51cfeb425b0959121c9);
* another published 64-byte single-block pair, reproduced in many MD5-collision demos.

The test first checks with hashlib that each pair really collides.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys

import pytest

from kcompact.compaction import CompactionOptions, Compactor
from kcompact.reput.config import ManualClock
from kcompact.reput.record import RecordBatch, key_digest
from kcompact.reput.store import Store
from kcompact.reput.verify import verify_store

sys.path.insert(0, os.path.dirname(__file__))
from _stores import backend, store_at  # noqa: E402,F401  (local and in-memory S3 stores)

WANG_1 = bytes.fromhex(
    "d131dd02c5e6eec4693d9a0698aff95c2fcab58712467eab4004583eb8fb7f89"
    "55ad340609f4b30283e488832571415a085125e8f7cdc99fd91dbdf280373c5b"
    "d8823e3156348f5bae6dacd436c919c6dd53e2b487da03fd02396306d248cda0"
    "e99f33420f577ee8ce54b67080a80d1ec69821bcb6a8839396f9652b6ff72a70")
WANG_2 = bytes.fromhex(
    "d131dd02c5e6eec4693d9a0698aff95c2fcab50712467eab4004583eb8fb7f89"
    "55ad340609f4b30283e4888325f1415a085125e8f7cdc99fd91dbd7280373c5b"
    "d8823e3156348f5bae6dacd436c919c6dd53e23487da03fd02396306d248cda0"
    "e99f33420f577ee8ce54b67080280d1ec69821bcb6a8839396f965ab6ff72a70")
SINGLE_1 = bytes.fromhex(
    "0e306561559aa787d00bc6f70bbdfe3404cf03659e704f8534c00ffb659c4c87"
    "40cc942feb2da115a3f4155cbb8607497386656d7d1f34a42059d78f5a8dd1ef")
SINGLE_2 = bytes.fromhex(
    "0e306561559aa787d00bc6f70bbdfe3404cf03659e744f8534c00ffb659c4c87"
    "40cc942feb2da115a3f415dcbb8607497386656d7d1f34a42059d78f5a8dd1ef")
STEVENS_1 = bytes.fromhex(
    "4dc968ff0ee35c209572d4777b721587d36fa7b21bdc56b74a3dc0783e7b9518"
    "afbfa200a8284bf36e8e4b55b35f427593d849676da0d1555d8360fb5f07fea2")
STEVENS_2 = bytes.fromhex(
    "4dc968ff0ee35c209572d4777b721587d36fa7b21bdc56b74a3dc0783e7b9518"
    "afbfa202a8284bf36e8e4b55b35f427593d849676da0d1d55d8360fb5f07fea2")
PAIRS = [(WANG_1, WANG_2), (STEVENS_1, STEVENS_2), (SINGLE_1, SINGLE_2)]
IDS = ["wang-yu-2004", "stevens-single-block", "single-block"]
TOPIC = "t"


@pytest.mark.parametrize("a,b", PAIRS, ids=IDS)
def test_pairs_really_collide_under_md5(a, b):
    assert a != b
    assert hashlib.md5(a).digest() == hashlib.md5(b).digest()
    assert hashlib.sha256(a).digest() != hashlib.sha256(b).digest()


@pytest.mark.parametrize("a,b", PAIRS, ids=IDS)
def test_siphash_digests_differ(a, b):
    for secret in [bytes(16), bytes(range(16))] + [secrets.token_bytes(16) for _ in range(20)]:
        da, db = key_digest(a, secret), key_digest(b, secret)
        assert da != db
        # each half differs too, so the offset map's 96 stored bits and its home slot differ
        assert da[0] != db[0] and da[1] != db[1]


@pytest.mark.parametrize("memory,load", [(4096, 0.1), (1 << 20, 0.9)])
def test_md5_colliding_keys_both_survive_compaction(store_at, memory, load):
    clock = ManualClock()
    s = Store.open(store_at("s"), writer="w", create=True, clock=clock)
    s.set_topic_config(TOPIC, {"segment.bytes": 16384})
    keys = [WANG_1, WANG_2, STEVENS_1, STEVENS_2, SINGLE_1, SINGLE_2]
    recs, off = [], 0
    for rnd in range(3):  # each key written three times, interleaved with filler keys
        for i, k in enumerate(keys):
            recs.append((0, off, clock.ms(), k, b"%d-v%d" % (i, rnd)))
            off += 1
            recs.append((0, off, clock.ms(), b"filler-%d" % (off % 40), b"x" * 200))
            off += 1
    s.append(RecordBatch.from_records(TOPIC, recs))
    s.flush()
    digests = {}
    pl = s.partition(TOPIC, 0)
    for seg in pl.segments:
        for e in seg.entries():
            digests.setdefault(int(e["offset"]), (int(e["digest_lo"]), int(e["digest_hi"])))
    for i in range(0, len(keys), 2):  # records 2i and 2i + 2 hold the two keys of pair i
        assert digests[2 * i] != digests[2 * i + 2]

    res = Compactor(s, CompactionOptions(offset_map_memory=memory, max_load=load),
                    clock).compact_partition(TOPIC, 0, force=True)
    assert res.rounds >= 1
    latest = {}
    for r in s.iter_records(TOPIC, 0):
        assert r.key not in latest, "one record per key after a forced compaction"
        latest[r.key] = r.value
    for i, k in enumerate(keys):
        assert latest[k] == b"%d-v2" % i, k[:8].hex()
    # an MD5-keyed map would have merged each pair into one key: 3 keys, not 6
    assert len({hashlib.md5(k).digest() for k in keys}) == 3
    assert len([k for k in latest if k in keys]) == 6
    assert verify_store(s).ok
