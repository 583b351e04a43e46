"""connectors/framework/_rdkafka.c under AddressSanitizer (issue 19): the extension is compiled
again with ``-fsanitize=address`` and loaded in a child Python (libasan preloaded, Python's
allocator switched to malloc so ASan sees its objects too) that drives every entry point of
kcompact's Kafka client against the session broker: consume into columns (headers, several
topics, end-of-partition events), metadata, watermarks, commit, pause, produce_columns with
headers and a partition per record, single produce with headers, a transaction committed and
one aborted, failed deliveries drained, a malformed header section refused, and unpack. Any
ASan report fails the test.

Opt-in (a compile and a slow child): ``pytest -m sanitizer tests/integration/test_rdkafka_asan.py``.
Leak detection is off: the interpreter itself does not free everything at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from kcompact.connectors.framework import native_kafka

pytestmark = pytest.mark.sanitizer

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent('''
    import importlib.util, sys, uuid
    spec = importlib.util.spec_from_file_location("kcompact.connectors.framework._rdkafka",
                                                  sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    import numpy as np
    from confluent_kafka import KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic
    from kcompact.connectors.framework import native_kafka
    from kcompact.connectors.framework.kafka_columns import PackedBytes, PackedHeaders
    from kcompact.reput.record import encode_headers
    sys.path.insert(0, sys.argv[3])
    from topics import packed_columns as cols
    assert native_kafka._native_module() is mod, native_kafka._why_not
    bootstrap = sys.argv[2]
    topics = ["asan-%s-%d" % (uuid.uuid4().hex[:8], i) for i in range(2)]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(t, 2, 1) for t in topics]).values():
        f.result(30)
    failures = []
    p = native_kafka.NativeProducer({
        "bootstrap.servers": bootstrap, "transactional.id": "asan-" + uuid.uuid4().hex[:8],
        "message.timeout.ms": 5000, "topic.metadata.propagation.max.ms": 500,
        "allow.auto.create.topics": False, "stats_cb": lambda s: None,
        "statistics.interval.ms": 100, "on_delivery": lambda e, m: failures.append(e)})
    p.init_transactions(30)
    n = 3000
    keys = [None if i % 97 == 0 else b"k%d" % i for i in range(n)]
    values = [None if i % 89 == 0 else b"v" * (i % 300) for i in range(n)]
    hs = [encode_headers([("h", b"x" * (i % 5)), ("n", None)]) if i % 3 else b""
          for i in range(n)]
    hstarts = np.cumsum([0] + [len(h) for h in hs[:-1]]).astype(np.int64)
    hends = hstarts + np.array([len(h) for h in hs], np.int64)
    for t in topics:
        p.begin_transaction()
        p.produce_columns(t, -1, (np.arange(n) % 2).astype(np.int32), cols(keys), cols(values),
                          np.arange(n, dtype=np.int64) + 1_700_000_000_000,
                          (b"".join(hs), hstarts, hends))
        p.produce(t, b"single", b"key", 0, None, None, 0, [("a", b"1"), ("b", None), ("c", "s")])
        p.commit_transaction(30)
    p.begin_transaction()
    p.produce_columns(topics[0], 1, None, cols([b"x"]), cols([b"y"]),
                      np.array([1], np.int64), None)
    p.abort_transaction(30)
    try:
        p.produce_columns(topics[0], 0, None, cols([b"x"]), cols([b"y"]),
                          np.array([1], np.int64),
                          (b"\\x05\\x00\\x00\\x00", np.array([0], np.int64),
                           np.array([4], np.int64)))
        raise SystemExit("a malformed header section was accepted")
    except ValueError:
        pass
    p.begin_transaction()
    p.produce_columns("asan-missing-" + uuid.uuid4().hex[:8], 0, None, cols([b"k"] * 3),
                      cols([b"v"] * 3), np.zeros(3, np.int64), None)
    try:
        p.commit_transaction(30)
        raise SystemExit("a failed delivery did not fail the commit")
    except KafkaException:
        p.abort_transaction(30)
    # the aborted transaction's record is purged (reported), the three to a missing topic fail
    assert sorted(e.code() for e in failures) == [-152, 3, 3, 3], failures
    p.list_topics(timeout=10)
    p.close()

    c = native_kafka.NativeConsumer({"bootstrap.servers": bootstrap,
                                     "enable.partition.eof": True, "enable.auto.commit": False,
                                     "isolation.level": "read_committed"})
    md = c.list_topics(topics[0], timeout=10)
    assert sorted(md.topics[topics[0]].partitions) == [0, 1]
    c.assign([TopicPartition(t, q, 0) for t in topics for q in range(2)])
    got, eofs = 0, 0
    while eofs < 4:
        b = c.consume_columns(700, 1.0)
        eofs += sum(1 for e in b.events if e.code == -191)
        if len(b):
            list(PackedBytes(*b.packed[:3])), list(PackedBytes(*b.packed[3:]))
            if b.headers is not None:
                list(PackedHeaders(*b.headers))
            b.topic_column()
        got += len(b)
    assert got == 2 * (n + 1), got
    c.get_watermark_offsets(TopicPartition(topics[0], 0), timeout=10)
    c.get_watermark_offsets(TopicPartition(topics[0], 0), cached=True)
    c.pause([TopicPartition(topics[0], 0)])
    c.commit([TopicPartition(topics[0], 0, 5)], asynchronous=False)
    c.close()

    buf, nulls = bytearray(b"abcdef"), np.array([0, 1, 0], np.uint8)
    assert mod.unpack(buf, np.array([0, 2, 2, 6], np.int64), nulls) == [b"ab", None, b"cdef"]
    print("ok")
''')


def test_client_is_clean_under_address_sanitizer(kafka_bootstrap, tmp_path, request):
    if "sanitizer" not in (request.config.option.markexpr or ""):
        pytest.skip("opt-in: run with -m sanitizer (compiles the extension with ASan)")
    if native_kafka._native_module() is None:
        pytest.skip(f"kcompact's Kafka client is not available: {native_kafka._why_not}")
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not libasan or not os.path.isabs(libasan):
        pytest.skip("gcc has no libasan")
    so = tmp_path / ("_rdkafka" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address",
                    "-fno-omit-frame-pointer", "-std=c11", "-D_GNU_SOURCE",
                    f"-I{ROOT / 'reput'}", f"-I{ROOT / 'third_party' / 'librdkafka' / 'include'}",
                    f"-I{sysconfig.get_paths()['include']}",
                    str(ROOT / "connectors" / "framework" / "_rdkafka.c"), "-ldl", "-lpthread",
                    "-o", str(so)], check=True)
    env = dict(os.environ, LD_PRELOAD=libasan, PYTHONMALLOC="malloc",
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=99")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(so), kafka_bootstrap,
                          str(Path(__file__).resolve().parent)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert "AddressSanitizer" not in res.stderr, res.stderr[-6000:]
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
