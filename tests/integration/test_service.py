"""Running kcompact as a service against the real broker fixture (issue 22): ``kv serve``
following a Kafka topic and answering reads (and ``kv get`` through it), ``mirror --follow``
with ``--metrics`` scraped mid-run, and Debian's Prometheus server scraping kcompact and
answering a query for one of its metrics (skipped with its reason when ``prometheus`` is not
installed: ``make test`` installs it).

Every process is a real ``kcompact`` command stopped by SIGTERM; every wait is bounded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
sys.path.insert(0, os.path.dirname(__file__))
from test_kv_kafka import ends, mirror_into_store, model, produce, rows  # noqa: E402
from test_kv_serve import (Proc, http, jget, kv_get, procs, scan_all, scrape,  # noqa: E402,F401
                           wait_for)


def test_kv_serve_follows_kafka_and_answers(kafka_bootstrap, make_topic, tmp_path, procs):
    topic = make_topic(partitions=3)
    first = produce(kafka_bootstrap, topic, rows(2000, 200, 11), 3)
    store, db = tmp_path / "store", tmp_path / "map"
    mirror_into_store(str(store), topic, first[:1000])
    srv = Proc(["kv", "serve", "--store", str(store), "--topic", topic, "--db", str(db),
                "--listen", "127.0.0.1:0", "--bootstrap-servers", kafka_bootstrap,
                "--metrics", "127.0.0.1:0"], tmp_path, "serve")
    procs.append(srv)
    url = srv.url_after(f"serving reads of {db} on ")
    murl = srv.url_after("metrics on ").rsplit("/metrics", 1)[0]
    srv.wait_line("caught up with Kafka")

    def offsets() -> dict[int, int]:
        return {int(p): o for p, o in jget(f"{url}/v1/offsets")["offsets"].items()}
    assert offsets() == ends(first)
    second = produce(kafka_bootstrap, topic, rows(1500, 200, 12), 3)
    wait_for(lambda: offsets() == ends(first + second), "the map follows the topic")
    expected = model(first + second)
    whole, _ = scan_all(url, 64)
    assert whole == expected
    k, v = sorted(expected.items())[7]
    r = kv_get(db, k.decode())
    assert r.returncode == 0 and r.stdout == v + b"\n", r.stderr
    m = scrape(murl)
    lag = {dict(lab)["partition"]: x for lab, x in m["kcompact_kv_lag_records"].items()}
    assert lag == {"0": 0.0, "1": 0.0, "2": 0.0}
    assert http(murl + "/healthz")[:3:2] == (200, b"ok\n")
    assert srv.stop() == 0


def _prometheus_query(prom: str, query: str) -> list:
    try:
        status, _, body = http(f"{prom}/api/v1/query?query={urllib.parse.quote(query)}")
    except OSError:  # still starting
        return []
    if status != 200:
        return []
    return json.loads(body)["data"]["result"]


def test_mirror_follow_metrics_scraped_by_prometheus(kafka_bootstrap, make_topic, tmp_path,
                                                    procs):
    topic = make_topic(partitions=2)
    produced = produce(kafka_bootstrap, topic, rows(1200, 100, 21), 2)
    store = tmp_path / "store"
    mirror = Proc(["mirror", "--bootstrap-servers", kafka_bootstrap, "--topic", topic,
                   "--store", str(store), "--follow", "--metrics", "127.0.0.1:0"],
                  tmp_path, "mirror")
    procs.append(mirror)
    murl = mirror.url_after("metrics on ").rsplit("/metrics", 1)[0]

    def records() -> float:
        return sum(scrape(murl).get("kcompact_records_total", {}).values())
    wait_for(lambda: records() == len(produced), "the mirror's records counter")
    m = scrape(murl)
    nxt = {dict(lab)["partition"]: v for lab, v in m["kcompact_next_offset"].items()}
    assert nxt == {str(p): float(o) for p, o in ends(produced).items()}
    wait_for(lambda: set(scrape(murl).get("kcompact_lag_records", {0: 1}).values()) == {0.0},
             "lag 0 once everything is mirrored")
    assert m["kcompact_bytes_total"] and min(m["kcompact_bytes_total"].values()) > 0
    # the last record's Kafka timestamp per partition, as the broker stored it
    last = {}
    for p, off, ts, *_ in produced:
        if off >= last.get(p, (-1, 0))[0]:
            last[p] = (off, ts)
    got_ts = {dict(lab)["partition"]: v
              for lab, v in m["kcompact_last_record_timestamp_seconds"].items()}
    assert got_ts == {str(p): ts / 1000 for p, (_, ts) in last.items()}
    # fsyncs of the commit log once the sink flushes (offset.flush.interval.ms, 5 s), after
    # the batches appended before (the sink's appender thread appends behind the counters)
    wait_for(lambda: scrape(murl).get("kcompact_fsync_seconds_count", {}).get(
        (("file", "commitlog"),), 0) >= 1, "the commit log's fsync counted")
    m = scrape(murl)
    # one append per batch stored: at least one, at most one per record
    n_append = m["kcompact_commitlog_append_seconds_count"][()]
    assert 1 <= n_append <= len(produced)
    assert m["kcompact_commitlog_append_seconds_bucket"][(("le", "+Inf"),)] == n_append
    assert http(murl + "/healthz")[:3:2] == (200, b"ok\n")

    prom_bin = shutil.which("prometheus")
    if prom_bin is None:
        assert mirror.stop() == 0
        pytest.skip("Debian's prometheus is not installed (make test installs it): the scrape "
                    "by a real Prometheus server was not tried")
    target = murl.split("://", 1)[1]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: kcompact\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom = subprocess.Popen([prom_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.err", "wb"))
    try:
        url = f"http://127.0.0.1:{port}"
        query = 'sum(kcompact_records_total{job="kcompact"})'
        wait_for(lambda: prom.poll() is None and _prometheus_query(url, query),
                 "Prometheus scrapes kcompact " + (tmp_path / "prom.err").read_text()[-300:])
        got = _prometheus_query(url, query)
        assert float(got[0]["value"][1]) == len(produced)
        up = _prometheus_query(url, 'up{job="kcompact"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
    assert mirror.stop() == 0
