"""Principals and ACLs on the Kafka endpoint (issue 54), with unmodified clients.

A store with five topics (orders, payments, team-a.events, team-b.events, team-b.secret) is
served by ``kcompact serve --kafka-listen`` as a process, with a users file made by ``kcompact
users add`` (password on stdin) and an ACL file in ``kafka-acls --list``'s words:

* alice (confluent-kafka, SCRAM-SHA-512): orders (literal) and team-a.* (prefixed); group g-alice;
* bob (confluent-kafka, PLAIN): team-b.* (prefixed) but a DENY READ on team-b.secret: he sees it
  in Metadata (READ's implied DESCRIBE is not denied) and reading it is
  TOPIC_AUTHORIZATION_FAILED (deny beats allow); groups g-bob*;
* carol (Kafka's Java ConsoleConsumer, SCRAM-SHA-256 through a JAAS config): payments, group
  carol-g;
* the client certificate CN=kcat,O=kcompact-test (kcat over mTLS): team-b.* .

Each principal's Metadata lists exactly the topics it may describe, reads exactly the topics it
may read, gets TOPIC_AUTHORIZATION_FAILED for the others and GROUP_AUTHORIZATION_FAILED for a
group it has no ACL for; a wrong password is SASL_AUTHENTICATION_FAILED with the endpoint's
message. Then: an edited ACL file is picked up while serving, a broken one keeps the previous
ACLs (one log line naming the line), and a broken one stops the start.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError

from kcompact.reput import ManualClock, Store
from kcompact.reput.record import Record, RecordBatch

sys.path.insert(0, os.path.dirname(__file__))
from endpoint_tools import (KCOMPACT, Endpoint, first_of_subscription, read_to_end,  # noqa: E402
                            sasl_conf)

pytestmark = pytest.mark.integration

TOPICS = ("orders", "payments", "team-a.events", "team-b.events", "team-b.secret")
PASSWORDS = {"alice": "alice-pw-" + uuid.uuid4().hex[:8], "bob": "bob-pw-" + uuid.uuid4().hex[:8],
             "carol": "carol-pw-" + uuid.uuid4().hex[:8]}
KCAT_DN = "User:CN=kcat,O=kcompact-test"

ACLS = f"""\
Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=orders, patternType=LITERAL)`: 
 \t(principal=User:alice, host=*, operation=READ, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=team-a., patternType=PREFIXED)`: 
 \t(principal=User:alice, host=*, operation=ALL, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=team-b., patternType=PREFIXED)`: 
 \t(principal=User:bob, host=*, operation=READ, permissionType=ALLOW)
\t(principal={KCAT_DN}, host=*, operation=READ, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=team-b.secret, patternType=LITERAL)`: 
 \t(principal=User:bob, host=*, operation=READ, permissionType=DENY) 

Current ACLs for resource `ResourcePattern(resourceType=TOPIC, name=payments, patternType=LITERAL)`: 
 \t(principal=User:carol, host=*, operation=READ, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=GROUP, name=g-alice, patternType=LITERAL)`: 
 \t(principal=User:alice, host=*, operation=READ, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=GROUP, name=g-bob, patternType=PREFIXED)`: 
 \t(principal=User:bob, host=*, operation=READ, permissionType=ALLOW) 

Current ACLs for resource `ResourcePattern(resourceType=GROUP, name=carol-g, patternType=LITERAL)`: 
 \t(principal=User:carol, host=*, operation=READ, permissionType=ALLOW) 

"""

#: principal -> (topics it may describe, topics it may read)
MATRIX = {
    "alice": ({"orders", "team-a.events"}, {"orders", "team-a.events"}),
    "bob": ({"team-b.events", "team-b.secret"}, {"team-b.events"}),
    "carol": ({"payments"}, {"payments"}),
}


#: a group each user may read (librdkafka looks its coordinator up even for assign())
GROUPS = {"alice": "g-alice", "bob": "g-bob-reader", "carol": "carol-g"}


def _records(topic: str) -> list[tuple[int, bytes, bytes]]:
    return [(i, f"{topic}-k{i}".encode(), f"{topic}-v{i}".encode()) for i in range(5)]


def build_store(url: str) -> str:
    """A store holding TOPICS (one partition of ``_records`` each)."""
    clock = ManualClock()
    st = Store.open(url, writer="w", create=True, clock=clock)
    for t in TOPICS:
        st.append(RecordBatch.from_records(t, [
            Record(t, 0, o, clock.ms() + o, k, v, ()) for o, k, v in _records(t)]))
    st.flush()
    st.close()
    return url


@pytest.fixture(scope="module")
def acl_store(tmp_path_factory) -> tuple[str, Path]:
    work = tmp_path_factory.mktemp("acls")
    url = build_store(str(work / "store"))
    users = work / "users"
    for name, mech in (("alice", "SCRAM-SHA-512"), ("bob", "PLAIN"),
                       ("carol", "SCRAM-SHA-256"), ("alice", "PLAIN")):
        r = subprocess.run([*KCOMPACT, "users", "add", "--file", str(users), "--mechanism",
                            mech, name], input=PASSWORDS[name] + "\n", capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    (work / "acls").write_text(ACLS)
    return url, work


@pytest.fixture(scope="module")
def certs(acl_store) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate CN=kcat, O=kcompact-test,
    made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = acl_store[1] / "tls"
    d.mkdir(exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=kcompact-test-ca")
    for name, subj, ext in (("server", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1"),
                            ("client", "/O=kcompact-test/CN=kcat", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", subj)
        (d / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {k: d / k for k in ("ca.pem", "server.pem", "server.key", "client.pem",
                               "client.key")}


@pytest.fixture(scope="module")
def endpoint(acl_store):
    url, work = acl_store
    ep = Endpoint(url, "--kafka-users-file", str(work / "users"), "--acls-file",
                  str(work / "acls"), "--metrics", "127.0.0.1:0", log=work / "ep.log").start()
    yield ep, work
    ep.stop()


def _conf(bs: str, user: str, mech: str, password: str | None = None, **extra) -> dict:
    return sasl_conf(bs, user, PASSWORDS[user] if password is None else password, mech, **extra)


def _read(conf: dict, topic: str) -> tuple[list, int | None]:
    """(the (offset, key, value) read from partition 0 to its end, or the error code)."""
    got, err = read_to_end(conf, topic, GROUPS[conf["sasl.username"]])
    return got, None if err is None else err.code()


def _named(conf: dict, topic: str) -> int | None:
    """The error of ``topic`` in a Metadata request naming it."""
    c = Consumer({**conf, "group.id": "unused"})
    try:
        e = c.list_topics(topic, timeout=15).topics[topic].error
        return None if e is None else e.code()
    finally:
        c.close()


def _visible(conf: dict) -> set[str]:
    c = Consumer({**conf, "group.id": "unused"})
    try:
        md = c.list_topics(timeout=15)
        return {t for t, tm in md.topics.items() if tm.error is None}
    finally:
        c.close()


@pytest.mark.parametrize("user,mech", [("alice", "SCRAM-SHA-512"), ("bob", "PLAIN"),
                                       ("alice", "PLAIN")])
def test_each_principal_reads_exactly_what_its_acls_allow(endpoint, user, mech):
    ep, _ = endpoint
    conf = _conf(ep.bootstrap, user, mech)
    describe, read = MATRIX[user]
    assert _visible(conf) == describe
    for t in TOPICS:
        if t not in describe:  # named in Metadata: TOPIC_AUTHORIZATION_FAILED
            assert _named(conf, t) == KafkaError.TOPIC_AUTHORIZATION_FAILED, (user, t)
            continue
        assert _named(conf, t) is None
        got, err = _read(conf, t)
        if t in read:
            assert err is None and got == [(o, k, v) for o, k, v in _records(t)], (t, err)
        else:  # described, not read: the Fetch is TOPIC_AUTHORIZATION_FAILED
            assert got == [] and err == KafkaError.TOPIC_AUTHORIZATION_FAILED, (user, t, err)


def _subscribe_error(conf: dict, topic: str, group: str) -> int | None:
    """The error a subscribing consumer of ``group`` meets, or None once it got (and
    committed) a record."""
    err = first_of_subscription(conf, topic, group, commit=True)
    return None if err is None else err.code()


def test_groups_are_authorized(endpoint):
    ep, _ = endpoint
    alice = _conf(ep.bootstrap, "alice", "SCRAM-SHA-512")
    assert _subscribe_error(alice, "orders", "g-alice") is None  # join, sync, commit allowed
    assert _subscribe_error(alice, "orders", "g-other") == KafkaError.GROUP_AUTHORIZATION_FAILED
    bob = _conf(ep.bootstrap, "bob", "PLAIN")
    assert _subscribe_error(bob, "team-b.events", "g-bob-1") is None  # prefixed group


def test_wrong_password_is_sasl_authentication_failed_with_a_reason(endpoint):
    ep, work = endpoint
    for user, mech in (("alice", "SCRAM-SHA-512"), ("bob", "PLAIN"), ("nobody", "PLAIN")):
        errors: list = []
        c = Consumer({**_conf(ep.bootstrap, user, mech, password="wrong",
                              error_cb=errors.append), "group.id": "x"})
        try:
            with pytest.raises(Exception):
                c.list_topics(timeout=2)
        finally:
            c.close()
        assert errors and errors[0].code() == KafkaError._AUTHENTICATION, errors
        assert "Authentication failed" in errors[0].str(), errors[0].str()
    assert "SASL authentication failed" in (work / "ep.log").read_text()


def test_users_file_holds_no_clear_password_and_is_private(acl_store):
    users = acl_store[1] / "users"
    text = users.read_text()
    assert stat.S_IMODE(users.stat().st_mode) == 0o600
    assert all(pw not in text for pw in PASSWORDS.values())
    assert len(text.splitlines()) == 4 and "alice SCRAM-SHA-512=[salt=" in text


def test_denials_are_logged_once_and_counted(endpoint):
    ep, work = endpoint
    import re
    import urllib.request
    url = re.search(r"metrics on (http://\S+/metrics)", (work / "ep.log").read_text()).group(1)

    def denied() -> float:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("kcompact_kafka_authorization_denied_total{") and all(
                    x in line for x in ('operation="READ"', 'principal="User:bob"',
                                        'resource_type="TOPIC"')):
                return float(line.split()[-1])
        return 0.0

    before = denied()
    conf = _conf(ep.bootstrap, "bob", "PLAIN")
    for _ in range(2):
        assert _read(conf, "team-b.secret")[1] == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert denied() >= before + 2
    lines = [x for x in (work / "ep.log").read_text().splitlines()
             if "denied User:bob READ on TOPIC 'team-b.secret'" in x]
    assert len(lines) == 1, lines


def test_acl_file_reloads_and_a_broken_one_keeps_the_previous(acl_store, tmp_path):
    url, work = acl_store
    acls = tmp_path / "acls"
    acls.write_text(ACLS)
    log = tmp_path / "ep.log"
    ep = Endpoint(url, "--kafka-users-file", str(work / "users"), "--acls-file", str(acls),
                  "--metrics", "127.0.0.1:0", log=log).start()
    try:
        carol = _conf(ep.bootstrap, "carol", "SCRAM-SHA-256")
        assert _visible(carol) == {"payments"}
        acls.write_text(ACLS + ACLS.splitlines()[0].replace("orders", "team-a.events") +
                        "\n\t(principal=User:carol, host=*, operation=READ, "
                        "permissionType=ALLOW)\n")
        deadline = time.monotonic() + 30
        while _visible(carol) != {"payments", "team-a.events"}:
            assert time.monotonic() < deadline, "the edited ACL file was not picked up"
            time.sleep(0.2)
        acls.write_text(ACLS + "garbage here\n")
        deadline = time.monotonic() + 30
        while "kept the previous ACLs" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            _visible(carol)
            time.sleep(0.2)
        n = len(ACLS.splitlines()) + 1
        assert f"line {n}: not a line kafka-acls --list prints" in log.read_text()
        assert _visible(carol) == {"payments", "team-a.events"}
    finally:
        ep.stop()
    bad = subprocess.run([*KCOMPACT, "serve", "--store", url, "--kafka-listen", "127.0.0.1:0",
                          "--acls-file", str(acls)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert f"line {n}: not a line kafka-acls --list prints" in bad.stderr, bad.stderr
    none = subprocess.run([*KCOMPACT, "serve", "--store", url, "--kafka-listen", "127.0.0.1:0",
                           "--acls-from-store"], capture_output=True, text=True, timeout=60)
    assert none.returncode == 1 and "run kcompact mirror" in none.stderr, none.stderr


def test_java_console_consumer_with_scram_sha_256(endpoint):
    """Kafka's own ConsoleConsumer, SCRAM-SHA-256 through a JAAS config, in group carol-g."""
    from kcompact.connectors.devtools.apache_kafka import find_java
    try:
        find_java()
    except Exception as e:  # noqa: BLE001 - no Java here
        pytest.skip(f"no Java: {e}")
    from endpoint_tools import java
    ep, work = endpoint
    props = work / "carol.properties"
    props.write_text(
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-256\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="carol" password="{PASSWORDS["carol"]}";\n')
    r = java("org.apache.kafka.tools.consumer.ConsoleConsumer", "--bootstrap-server",
             ep.bootstrap, "--topic", "payments", "--group", "carol-g", "--from-beginning",
             "--max-messages", "5", "--timeout-ms", "30000", "--consumer.config", str(props),
             "--property", "print.key=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [f"{k.decode()}\t{v.decode()}"
                                     for _, k, v in _records("payments")]
    r = java("org.apache.kafka.tools.consumer.ConsoleConsumer", "--bootstrap-server",
             ep.bootstrap, "--topic", "orders", "--group", "carol-g", "--from-beginning",
             "--max-messages", "1", "--timeout-ms", "20000", "--consumer.config", str(props))
    assert "TopicAuthorizationException: Not authorized to access topics: [orders]" in \
        r.stderr, r.stderr[-3000:]


def _kcat() -> str:
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        pytest.skip("kcat is not installed (Debian: apt-get install kcat; `make kcat`)")
    return kcat


def test_kcat_with_a_client_certificate(acl_store, certs, tmp_path):
    url, work = acl_store
    kcat = _kcat()
    ep = Endpoint(url, "--tls-cert", str(certs["server.pem"]), "--tls-key",
                  str(certs["server.key"]), "--tls-client-ca", str(certs["ca.pem"]),
                  "--acls-file", str(work / "acls"), log=tmp_path / "ep.log").start()
    tls = ["-X", "security.protocol=SSL", "-X", f"ssl.ca.location={certs['ca.pem']}",
           "-X", f"ssl.certificate.location={certs['client.pem']}",
           "-X", f"ssl.key.location={certs['client.key']}"]
    try:
        r = subprocess.run([kcat, "-b", ep.bootstrap, *tls, "-L", "-J"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        import json
        listed = {t["topic"] for t in json.loads(r.stdout)["topics"] if not t.get("error")}
        assert listed == {"team-b.events", "team-b.secret"}
        r = subprocess.run([kcat, "-b", ep.bootstrap, *tls, "-C", "-t", "team-b.secret", "-p",
                            "0", "-o", "beginning", "-e", "-f", "%k=%s\\n"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [f"{k.decode()}={v.decode()}"
                                         for _, k, v in _records("team-b.secret")]
        r = subprocess.run([kcat, "-b", ep.bootstrap, *tls, "-C", "-t", "orders", "-p", "0",
                            "-o", "beginning", "-e"], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "authoriz" in r.stderr.lower(), r.stderr
        # no client certificate: the TLS handshake fails, with the reason in the log
        r = subprocess.run([kcat, "-b", ep.bootstrap, "-X", "security.protocol=SSL", "-X",
                            f"ssl.ca.location={certs['ca.pem']}", "-L", "-m", "5"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
    finally:
        ep.stop()
    assert "TLS handshake failed" in (tmp_path / "ep.log").read_text()
