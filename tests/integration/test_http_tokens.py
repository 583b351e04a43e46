"""Named tokens limited to topics on the HTTP servers (issue 54): ``kcompact serve --listen
--tokens-file`` and ``kcompact kv serve --tokens-file``, tokens made by ``kcompact tokens add``.

A token for team-a.* lists and replicates team-a.* only: /v1/topics and /v1/store leave the
others out, any resource of another topic is 403 with the JSON error document, and ``kcompact
replicate`` with that token builds a replica of team-a.* alone. The tokens file holds no clear
token; the single ``--token-file`` keeps working beside it. ``kv serve`` of one topic answers
only a token allowed that topic.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import KCOMPACT  # noqa: E402
from test_kafka_endpoint_acls import TOPICS, build_store  # noqa: E402

pytestmark = pytest.mark.integration


def _kc(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KCOMPACT, *args], capture_output=True, text=True, timeout=120, **kw)


class Serving:
    def __init__(self, args: list[str], err):
        self.err = err
        self.p = subprocess.Popen([*KCOMPACT, *args], stdout=subprocess.DEVNULL,
                                  stderr=open(err, "wb"))

    def url_after(self, text: str) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in self.err.read_text().splitlines():
                if text in line:
                    return line.split(text, 1)[1].split()[0]
            assert self.p.poll() is None, self.err.read_text()
            time.sleep(0.05)
        raise AssertionError(self.err.read_text())

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        self.p.wait(60)


def _get(url: str, token: str) -> tuple[int, object]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get_content_type() == \
                "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    work = tmp_path_factory.mktemp("tokens")
    url = build_store(str(work / "store"))
    f = work / "tokens"
    made = {}
    for name, topics in (("team-a", "team-a.*"), ("orders-only", "orders"),
                         ("everything", "*")):
        r = _kc("tokens", "add", "--file", str(f), "--topics", topics, name)
        assert r.returncode == 0, r.stderr
        made[name] = r.stdout.strip()
    return url, work, f, made


def test_tokens_file_is_hashed_and_private(tokens):
    _, _, f, made = tokens
    text = f.read_text()
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert all(t not in text for t in made.values()) and text.count("sha256:") == 3
    bad = f.parent / "bad"
    bad.write_text("x sha256:abc team-a\n")
    r = _kc("serve", "--store", tokens[0], "--listen", "127.0.0.1:0", "--tokens-file", str(bad))
    assert r.returncode == 1 and f"tokens file {bad} line 1:" in r.stderr, r.stderr


def test_a_token_for_some_topics_cannot_list_or_read_others(tokens, tmp_path):
    url, work, f, made = tokens
    single = work / "single"
    single.write_text("a-single-token-for-all-1234\n")
    srv = Serving(["serve", "--store", url, "--listen", "127.0.0.1:0", "--tokens-file", str(f),
                   "--token-file", str(single)], tmp_path / "serve.err")
    try:
        base = srv.url_after(" on ")
        st, doc = _get(f"{base}/v1/topics", made["team-a"])
        assert st == 200 and doc["topics"] == ["team-a.events"]
        st, doc = _get(f"{base}/v1/store", made["team-a"])
        assert st == 200 and [t["topic"] for t in doc["topics"]] == ["team-a.events"]
        st, doc = _get(f"{base}/v1/topics/team-a.events/partitions/0", made["team-a"])
        assert st == 200
        for path in ("/v1/topics/orders", "/v1/topics/orders/partitions/0",
                     "/v1/topics/orders/partitions/0/records?from=0",
                     "/v1/topics/no-such-topic/partitions/0"):
            st, doc = _get(base + path, made["team-a"])
            assert st == 403 and "token team-a may not read topic" in doc["error"], (path, doc)
        st, doc = _get(f"{base}/v1/topics", made["orders-only"])
        assert doc["topics"] == ["orders"]
        for tok in (made["everything"], single.read_text().strip()):
            st, doc = _get(f"{base}/v1/topics", tok)
            assert st == 200 and sorted(doc["topics"]) == sorted(TOPICS)
        st, doc = _get(f"{base}/v1/topics", "not-a-token-at-all-0000")
        assert st == 403 and doc["error"] == "wrong bearer token"
        # replicate with the team-a token: a replica of team-a.* only
        tf = tmp_path / "team-a.token"
        tf.write_text(made["team-a"] + "\n")
        r = _kc("replicate", "--from", base, "--token-file", str(tf), "--store",
                str(tmp_path / "replica"))
        assert r.returncode == 0, r.stderr
        from kcompact.reput import Store
        rep = Store.open(str(tmp_path / "replica"))
        try:
            assert sorted(rep.topics()) == ["team-a.events"]
        finally:
            rep.close()
    finally:
        srv.stop()


def test_kv_serve_answers_only_a_token_for_its_topic(tokens, tmp_path):
    url, _, f, made = tokens
    srv = Serving(["kv", "serve", "--store", url, "--topic", "orders", "--db",
                   str(tmp_path / "db"), "--listen", "127.0.0.1:0", "--tokens-file", str(f)],
                  tmp_path / "kv.err")
    try:
        base = srv.url_after("serving reads of " + str(tmp_path / "db") + " on ")
        for name in ("orders-only", "everything"):
            st, doc = _get(f"{base}/v1/offsets", made[name])
            assert st == 200 and doc["topic"] == "orders", doc
        st, doc = _get(f"{base}/v1/offsets", made["team-a"])
        assert st == 403 and "token team-a may not read topic orders" in doc["error"], doc
    finally:
        srv.stop()
