"""One door to a partition (issue 48): every reader and writer opens a partition through its
store (``Store.open_view``, ``Store.partition``, ``Store.views``), with the store's topic config
and strictness, so a partition one command refuses no other serves.

The issue's case: a partition whose segment list (segments.json) is gone, in a store that keeps
one per partition. Before, ``kcompact dump`` refused it with the store's line while the Kafka
endpoint and the replication master opened it their own way (no topic config, no
``require_list``) and refused it, when they did, with another. Now ``dump``, ``kv build``, the
replication master (what ``kcompact serve`` answers on /v1/store and what ``kcompact
replicate`` names), the Kafka endpoint (``serve --kafka-listen``: KAFKA_STORAGE_ERROR, the
damage it records) and replication's verify all refuse it with the same one line, and serve
partition 1. This is the in-process check, through the layers' objects;
tests/integration/test_one_door_commands.py runs the same case as a user does, every command a
``kcompact`` process (``serve``, ``replicate``) and the endpoint read by confluent-kafka and kcat.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from test_issue51_damage import KAFKA_STORAGE_ERROR, N, TOPIC, build, dumped, pdir, run  # noqa: E402

from kcompact.reput import damage_record as DR  # noqa: E402
from kcompact.reput import filenames as fn  # noqa: E402
from kcompact.reput.errors import CorruptRecordError  # noqa: E402
from kcompact.reput.store import Store  # noqa: E402


def _refusal(url: str) -> str:
    """The one line the store refuses partition 0 with (its open through the door)."""
    with Store.open(url) as st:
        try:
            st.partition(TOPIC, 0)
        except CorruptRecordError as e:
            return str(e).strip()
    raise AssertionError("partition 0 opened without its segment list")


def test_a_partition_without_its_segment_list_is_refused_alike_everywhere(tmp_path):
    from test_kafka_endpoint_model import Client, Served

    from kcompact.replication.client import unavailable_partitions
    from kcompact.replication.master_store import MasterStore
    from kcompact.replication.protocol import ServerLimits

    url = str(tmp_path / "s")
    build(url)
    keep1 = dumped(url, 1)
    os.remove(os.path.join(pdir(url, 0), fn.SEGMENT_LIST))
    line = _refusal(url)
    assert "\n" not in line and f"{fn.partition_dir(TOPIC, 0)}/segments.json" in line, line

    # kcompact dump and kv build: one line each, the store's (kv build names the topic it
    # refuses around it)
    code, out, err = run("dump", "--store", url, "--topic", TOPIC, "--partition", "0")
    assert code == 1 and out == "" and err.strip().splitlines() == [f"kcompact: error: {line}"]
    code, out, err = run("kv", "build", "--store", url, "--topic", TOPIC, "--db",
                         str(tmp_path / "db"))
    (last,) = [ln for ln in err.strip().splitlines() if ln.startswith("kcompact: error: ")]
    assert code == 1 and f"partition t-0 is damaged ({line})" in last, err  # (and its hint)

    # the replication master (kcompact serve): partition 0 unavailable with that line, what
    # kcompact replicate names; partition 1 served
    master = MasterStore(url, ServerLimits())
    try:
        doc = master.store_doc()
        assert unavailable_partitions(doc) == [(TOPIC, 0, f"damaged on the master: {line}")]
        (topic,) = doc["topics"]
        assert [p["partition"] for p in topic["partitions"]] == [1]
        assert master.partition_info(TOPIC, 1)["next_offset"] == N
    finally:
        master.store.close()

    # the Kafka endpoint (serve --kafka-listen): KAFKA_STORAGE_ERROR for partition 0, the same
    # line recorded as its damage; partition 1 served
    srv = Served(url)
    try:
        c = Client(srv.port)
        err0, *_ = c.fetch(12, 0, 1 << 20, partition=0)
        assert err0 == KAFKA_STORAGE_ERROR
        assert c.list_offsets(-1, partition=0) == (KAFKA_STORAGE_ERROR, -1)
        err1, hwm, _, raw = c.fetch(12, 0, 1 << 20, partition=1)
        assert (err1, hwm) == (0, N) and raw
        c.close()
    finally:
        srv.close()
    with Store.open(url) as st:
        assert DR.read(st.fs, TOPIC, 0)["reason"] == line
        # replication's verify and every other reader: the same door
        try:
            st.open_view(TOPIC, 0)
            raise AssertionError("open_view opened partition 0")
        except CorruptRecordError as e:
            assert str(e).strip() == line
    assert dumped(url, 1) == keep1


# -- a partition's catalog is private (issue 48) ------------------------------------------------

#: reaching into a partition's catalog: anything's ``._catalog`` but ``self``'s (the
#: partition's own), or a partition's ``.catalog`` by the names it goes by (``pl``, ``part``,
#: ``log``, ``view``, ``store.partition(...)``); other objects' ``catalog`` (a journal's
#: heads, a shared piece's) are theirs
FOREIGN_CATALOG = re.compile(r"\b(?!self\b)\w+\._catalog\b|\b(?:pl|part|log|view)\.catalog\b"
                             r"|\.partition\([^)]*\)\.catalog\b")


def _foreign_catalogs(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [(i, ln.strip()) for i, ln in enumerate(f, 1)
                if FOREIGN_CATALOG.search(ln) and "import" not in ln]


def test_nothing_reaches_into_a_partitions_catalog():
    """``PartitionLog``'s catalog is private: the compactor, publishing, compaction objects,
    verify, replication and the connectors call the partition's methods (``stage_swap``,
    ``commit_staged``, ``staged_segments``, ``reload_manifest``...), never its catalog's."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bad = []
    for top in ("reput", "compaction", "replication", "connectors"):
        for d, _, names in os.walk(os.path.join(root, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(d, name)
                    bad += [f"{os.path.relpath(path, root)}:{i}: {t}"
                            for i, t in _foreign_catalogs(path)]
    assert not bad, "a partition's catalog reached from outside:\n" + "\n".join(bad)


@pytest.mark.parametrize("source,reaches", [
    ("pl.catalog.stage_swap([], [], None)", True),
    ("cat = it.pl._catalog", True),
    ("self._catalog.load()", False),
    ("from .catalog import SegmentCatalog", False),
    ("st.partition(\"t\", 0).catalog.shared_objects", True),
    ("if heads.catalog is not None:", False),
    ("SC.catalog_path(3)", False),
    ("pl.stage_swap([], [], None)", False),
])
def test_the_catalog_check_sees_a_reach(tmp_path, source, reaches):
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert bool(_foreign_catalogs(str(f))) == reaches
