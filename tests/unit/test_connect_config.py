"""Connect-style configuration: properties/JSON files, ConfigDef validation, connector and worker
validation, error handling (retry, tolerance, dead-letter headers). No processes."""

from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcompact.connectors.framework.api import DataError, RetriableError
from kcompact.connectors.framework.config import (ConfigDef, Importance, Type, at_least, between,
                                                  load_config_file, one_of, parse_kv_pairs,
                                                  parse_properties)
from kcompact.connectors.errors import ConfigError
from kcompact.connectors.framework.errors_handling import (ERRORS_CONFIG, H_EXC_CLASS,
                                                           H_EXC_MESSAGE, H_EXC_STACKTRACE,
                                                           H_OFFSET, H_PARTITION, H_STAGE, H_TOPIC,
                                                           SKIPPED, DeadLetterQueue, ErrorContext,
                                                           ErrorHandler, Stage)
from kcompact.connectors.apps.options import mirror_props, parse_partitions
from kcompact.connectors.framework.kafka_clients import KafkaSettings, short_lived
from kcompact.connectors.framework.worker import (CONNECTOR_CONFIG, WORKER_CONFIG, Worker,
                                                  connector_class, validate_connector)

# -- properties files ----------------------------------------------------------------------------


def test_properties_separators_comments_and_blank_lines():
    text = """
# a comment
! another comment
name=store-sink
connector.class : StoreSinkConnector
tasks.max 2
   topics   =   orders,payments
store.url=file:///data/store?x=1
empty=
"""
    assert parse_properties(text) == {
        "name": "store-sink", "connector.class": "StoreSinkConnector", "tasks.max": "2",
        "topics": "orders,payments", "store.url": "file:///data/store?x=1", "empty": ""}


def test_properties_continuations_and_escapes():
    text = ("topics=a,\\\n    b,\\\n    c\n"
            "key\\=with\\:seps=v\n"
            "tab=x\\ty\n"
            "uni=\\u0041\\u00e9\n"
            "backslash=C:\\\\dir\n"
            "dup=1\n"
            "dup=2\n")
    got = parse_properties(text)
    assert got["topics"] == "a,b,c"
    assert got["key=with:seps"] == "v"
    assert got["tab"] == "x\ty"
    assert got["uni"] == "Aé"
    assert got["backslash"] == "C:\\dir"
    assert got["dup"] == "2"  # last wins, as java.util.Properties


def test_properties_even_backslashes_do_not_continue():
    assert parse_properties("a=x\\\\\nb=y\n") == {"a": "x\\", "b": "y"}


def test_properties_bad_unicode_escape_names_the_line():
    with pytest.raises(ConfigError, match=r"f.properties:2: malformed \\uXXXX"):
        parse_properties("a=1\nb=\\u12\n", where="f.properties")


def _java_escape(s: str, key: bool) -> str:
    out = []
    for i, c in enumerate(s):
        if c == "\\":
            out.append("\\\\")
        elif c == "\t":
            out.append("\\t")
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\f":
            out.append("\\f")
        elif c in "=:#!":
            out.append("\\" + c)
        elif c == " " and (key or i == 0):
            out.append("\\ ")
        else:
            out.append(c)
    return "".join(out)


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_text.filter(bool), _text, max_size=8))
def test_properties_round_trip_with_java_escaping(props):
    text = "".join(f"{_java_escape(k, True)}={_java_escape(v, False)}\n"
                   for k, v in props.items())
    assert parse_properties(text) == props


def test_load_config_file_properties_and_json(tmp_path):
    p = tmp_path / "c.properties"
    p.write_text("name=a\ntasks.max=3\n")
    assert load_config_file(p) == {"name": "a", "tasks.max": "3"}
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"name": "b", "config": {"tasks.max": 2, "topics": "t"}}))
    assert load_config_file(j) == {"tasks.max": 2, "topics": "t", "name": "b"}
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"name": "c", "follow": False}))
    assert load_config_file(flat) == {"name": "c", "follow": False}


def test_load_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.properties: no such file"):
        load_config_file(tmp_path / "nope.properties")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",\n "topics": }')
    with pytest.raises(ConfigError, match=r"bad.json:2: invalid JSON"):
        load_config_file(bad)
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"name": "x", "consumer": {"a": 1}}))
    with pytest.raises(ConfigError, match="'consumer' must be a string"):
        load_config_file(nested)


def test_parse_kv_pairs():
    assert parse_kv_pairs(["a=1", "b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="-X expects key=value; got 'oops'"):
        parse_kv_pairs(["oops"])


# -- ConfigDef ---------------------------------------------------------------------------------


def _def() -> ConfigDef:
    return (ConfigDef()
            .define("name", Type.STRING, doc="The name.")
            .define("tasks.max", Type.INT, 1, at_least(1))
            .define("ratio", Type.DOUBLE, 0.5, between(0, 1))
            .define("follow", Type.BOOLEAN, True)
            .define("topics", Type.LIST, [])
            .define("mode", Type.STRING, "none", one_of("none", "all"), Importance.HIGH)
            .with_passthrough("consumer."))


def test_configdef_types_and_defaults():
    got = _def().parse({"name": "x", "tasks.max": "4", "ratio": "0.25", "follow": "FALSE",
                        "topics": " a, b ,,c ", "consumer.fetch.min.bytes": "1"})
    assert got == {"name": "x", "tasks.max": 4, "ratio": 0.25, "follow": False,
                   "topics": ["a", "b", "c"], "mode": "none", "consumer.fetch.min.bytes": "1"}
    assert _def().parse({"name": "x", "tasks.max": 2, "follow": True, "topics": ["a"]})[
        "topics"] == ["a"]


@pytest.mark.parametrize("props, message", [
    ({}, "missing required property 'name'"),
    ({"name": "x", "tasks.max": "0"}, "tasks.max: 0 is out of range: must be at least 1"),
    ({"name": "x", "tasks.max": "two"}, "tasks.max: expected an integer; got 'two'"),
    ({"name": "x", "tasks.max": "99999999999"}, "tasks.max: 99999999999 does not fit an? int"),
    ({"name": "x", "ratio": "2"}, r"ratio: 2.0 is out of range \[0, 1\]"),
    ({"name": "x", "follow": "yes"}, "follow: expected true or false; got 'yes'"),
    ({"name": "x", "mode": "some"}, "mode: expected one of none, all; got 'some'"),
    ({"name": "x", "tasks.maxx": "1"}, "unknown property 'tasks.maxx'; did you mean 'tasks.max'"),
    ({"name": "x", "producer.acks": "1"}, "unknown property 'producer.acks'"),
])
def test_configdef_errors_name_the_key(props, message):
    with pytest.raises(ConfigError, match=message):
        _def().parse(props, where="w.properties")


def test_unknown_key_lists_known_keys_and_prefixes():
    with pytest.raises(ConfigError) as e:
        _def().parse({"name": "x", "bogus": "1"}, where="c.properties")
    msg = str(e.value)
    assert msg.startswith("c.properties: unknown property 'bogus'")
    assert "Known properties: follow, mode, name, ratio, tasks.max, topics" in msg
    assert "'consumer.'" in msg


def test_default_must_pass_its_validator():
    with pytest.raises(ConfigError):
        ConfigDef().define("n", Type.INT, 0, at_least(1))


def test_markdown_table_lists_every_key():
    table = ERRORS_CONFIG.markdown_table()
    for k in ERRORS_CONFIG.names():
        assert f"`{k}`" in table


# -- connector and worker validation -------------------------------------------------------------


def _sink_props(**extra):
    p = {"name": "s", "connector.class": "StoreSinkConnector", "topics": "t",
         "store.url": "/tmp/x"}
    p.update(extra)
    return p


def test_connector_validation_accepts_a_full_store_sink_config():
    cls, values = validate_connector(_sink_props(**{
        "tasks.max": "2", "errors.tolerance": "all",
        "errors.deadletterqueue.topic.name": "dlq", "value.converter": "AvroConverter",
        "value.converter.schema.registry.url": "http://sr:8081",
        "consumer.override.fetch.min.bytes": "1", "store.partitions": "0,1"}), where="c")
    assert cls.__name__ == "StoreSinkConnector"
    assert values["tasks.max"] == 2 and values["errors.tolerance"] == "all"
    assert values["store.partitions"] == ["0", "1"]


@pytest.mark.parametrize("name", ["StoreSinkConnector", "StoreSourceConnector",
                                  "LevelDBSinkConnector"])
def test_connector_class_names_of_every_layout_resolve(name):
    """Short names, the module paths of today, and the dotted names of earlier layouts (kcompact
    0.1's connectors.X, and kcompact.connectors.X before the plugins had a folder) all name the
    same class: properties files written for any of them keep working."""
    module = {"StoreSinkConnector": "store_sink", "StoreSourceConnector": "store_source",
              "LevelDBSinkConnector": "leveldb_connector"}[name]
    cls = connector_class(name)
    assert cls.__name__ == name and cls.__module__.startswith("kcompact.connectors.plugins.")
    for spelled in (f"connectors.{module}.{name}", f"kcompact.connectors.{module}.{name}",
                    f"kcompact.connectors.plugins.{module}.{name}"):
        assert connector_class(spelled) is cls, spelled
    # the example properties files name them so
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    for f in os.listdir(examples):
        doc = load_config_file(os.path.join(examples, f))
        if doc.get("connector.class"):
            connector_class(doc["connector.class"])


@pytest.mark.parametrize("extra, message", [
    ({"store.urll": "/x"}, "unknown property 'store.urll'; did you mean 'store.url'"),
    ({"errors.tolerance": "most"}, "errors.tolerance: expected one of none, all; got 'most'"),
    ({"errors.retry.timeout": "-5"}, "errors.retry.timeout: -5 is out of range"),
    ({"connector.class": "FileStreamSink"},
     r"unknown connector 'FileStreamSink' \(built-in: StoreSinkConnector, StoreSourceConnector, "
     r"LevelDBSinkConnector\)"),
    ({"connector.class": "org.apache.kafka.connect.file.FileStreamSinkConnector"},
     "is a Java class; kcompact runs Python connectors"),
    ({"connector.class": "json.JSONDecoder"}, "is not a kcompact Connector subclass"),
    ({"connector.class": "no_such_module_xyz.Conn"}, "cannot import module 'no_such_module_xyz'"),
    ({"topics": ""}, "missing required property 'topics'"),
])
def test_connector_validation_errors_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        validate_connector(_sink_props(**extra), where="sink.properties")


def test_worker_validation():
    with pytest.raises(ConfigError, match="missing required property 'bootstrap.servers'"):
        Worker({})
    # listeners is known since the REST API (connectors/apps/connect_rest/); distributed
    # mode's keys are not
    with pytest.raises(ConfigError, match="unknown property 'config.storage.topic'"):
        Worker({"bootstrap.servers": "b:9092", "config.storage.topic": "connect-configs"})
    w = Worker({"bootstrap.servers": "b:9092", "consumer.fetch.min.bytes": "1",
                "value.converter.schemas.enable": "false"})
    assert w.bootstrap == "b:9092"
    assert "bootstrap.servers" in WORKER_CONFIG and "name" in CONNECTOR_CONFIG


def test_converter_keys_are_validated_by_the_converter():
    w = Worker({"bootstrap.servers": "b:9092"})
    with pytest.raises(ConfigError, match=r"value.converter \(JsonConverter\): unknown property "
                                          r"'schemas.enabled'; did you mean 'schemas.enable'"):
        w._converter("value", {"value.converter": "JsonConverter"},
                     {"value.converter.schemas.enabled": "true"})
    with pytest.raises(ConfigError, match="key.converter: unknown converter 'Nope'"):
        w._converter("key", {"key.converter": "Nope"}, {})


def test_kafka_settings_reject_overrides_the_task_needs():
    s = KafkaSettings({"enable.auto.commit": False})
    s.update({"isolation.level": "read_uncommitted"}, lambda k: f"-X {k}")
    with pytest.raises(ConfigError, match="-X isolation.level=read_uncommitted: StoreSinkConnector "
                                          "needs isolation.level=read_committed"):
        s.require({"isolation.level": "read_committed"}, "StoreSinkConnector")
    s = KafkaSettings({})
    s.update({"enable.auto.commit": "FALSE"}, lambda k: k)
    s.require({"enable.auto.commit": "false"}, "w")  # same value, other spelling: fine
    assert s.conf["enable.auto.commit"] == "false"


def test_short_lived_clients_reconnect_sooner_unless_the_user_says():
    # a probe or an admin client makes a request or two: librdkafka's 100 ms reconnect backoff
    # made one fresh client in three wait 50 ms for its first metadata (kafka_clients.py)
    conf = {"bootstrap.servers": "b:9092", "security.protocol": "SSL"}
    assert short_lived(conf) == dict(conf, **{"reconnect.backoff.ms": 10})
    assert conf == {"bootstrap.servers": "b:9092", "security.protocol": "SSL"}  # not changed
    mine = dict(conf, **{"reconnect.backoff.ms": 250})
    assert short_lived(mine)["reconnect.backoff.ms"] == 250


def test_mirror_arguments():
    assert parse_partitions("0,2, 5-7") == (0, 2, 5, 6, 7)
    assert parse_partitions(None) is None
    with pytest.raises(ConfigError, match="--partitions: 'x' is not a partition number"):
        parse_partitions("1,x")
    props = mirror_props("t", "/s", partitions=[1], follow=False,
                         kafka_config={"fetch.min.bytes": "1"})
    assert props["consumer.override.fetch.min.bytes"] == "1"
    assert props["store.partitions"] == "1" and props["store.writer"] == "local"
    with pytest.raises(ConfigError, match="-X bootstrap.servers: use --bootstrap-servers"):
        mirror_props("t", "/s", partitions=None, follow=False,
                     kafka_config={"bootstrap.servers": "x"})


# -- error handling ----------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def _ctx(stage=Stage.VALUE_CONVERTER) -> ErrorContext:
    return ErrorContext("orders", 3, 42, 1_700_000_000_000, b"k", b"\x01bad", [("h", b"1")],
                        stage, "kcompact.connectors.framework.converters.AvroConverter")


def _handler(**cfg) -> tuple[ErrorHandler, _Clock]:
    clock = _Clock()
    values = ERRORS_CONFIG.parse(cfg)
    return ErrorHandler(values, connector="c", task_id=0, sleep=clock.sleep, clock=clock), clock


def test_retriable_error_is_retried_with_backoff_until_the_timeout():
    h, clock = _handler(**{"errors.retry.timeout": "5000", "errors.retry.delay.max.ms": "1000"})
    calls = []

    def op():
        calls.append(clock.t)
        raise RetriableError("Schema Registry at http://sr is unreachable")
    with pytest.raises(RetriableError, match="unreachable .*after retrying for .* at orders-3 "
                                             "offset 42"):
        h.execute(op, _ctx())
    assert clock.sleeps[:3] == [0.3, 0.6, 1.0] and max(clock.sleeps) == 1.0
    assert clock.t <= 5.0 and len(calls) == len(clock.sleeps) + 1


def test_retriable_error_that_recovers():
    h, clock = _handler(**{"errors.retry.timeout": "-1"})
    n = iter(range(10))

    def op():
        if next(n) < 3:
            raise RetriableError("down")
        return "ok"
    assert h.execute(op, _ctx()) == "ok"
    assert h.retries == 3


def test_no_retry_by_default_and_never_tolerated():
    h, clock = _handler(**{"errors.tolerance": "all"})
    with pytest.raises(RetriableError, match=r"errors.retry.timeout=0: no retries"):
        h.execute(lambda: (_ for _ in ()).throw(RetriableError("down")), _ctx())
    assert clock.sleeps == []


def test_tolerance_none_stops_naming_the_record():
    h, _ = _handler()
    with pytest.raises(DataError, match="value converter failed on orders-3 offset 42: bad magic; "
                                        "set errors.tolerance=all"):
        h.execute(lambda: (_ for _ in ()).throw(DataError("bad magic")), _ctx())
    assert h.errors == 1


class _FakeProducer:
    def __init__(self, fail: str | None = None):
        self.sent: list[dict] = []
        self.fail = fail
        self._cbs = []

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None, **kw):
        self.sent.append(dict(topic=topic, key=key, value=value, headers=headers, **kw))
        self._cbs.append(on_delivery)

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        class Err:
            def __init__(self, s):
                self.s = s

            def str(self):
                return self.s
        for cb in self._cbs:
            cb(Err(self.fail) if self.fail else None, None)
        self._cbs.clear()
        return 0


def test_tolerance_all_sends_to_the_dead_letter_topic_with_connect_headers():
    prod = _FakeProducer()
    dlq = DeadLetterQueue(prod, "dlq", connector="mirror", task_id=0)
    values = ERRORS_CONFIG.parse({"errors.tolerance": "all",
                                  "errors.deadletterqueue.topic.name": "dlq"})
    h = ErrorHandler(values, connector="mirror", task_id=0, dlq=dlq)

    def bad():
        raise DataError("AvroConverter: unknown magic byte 1")
    assert h.execute(bad, _ctx()) is SKIPPED
    h.flush_dlq()
    (rec,) = prod.sent
    assert rec["topic"] == "dlq" and rec["key"] == b"k" and rec["value"] == b"\x01bad"
    assert rec["timestamp"] == 1_700_000_000_000
    hdrs = rec["headers"]
    assert hdrs[0] == ("h", b"1")  # the record's own headers come first, unchanged
    d = dict(hdrs[1:])
    assert d[H_TOPIC] == b"orders" and d[H_PARTITION] == b"3" and d[H_OFFSET] == b"42"
    assert d[H_STAGE] == b"VALUE_CONVERTER"
    assert d[H_EXC_CLASS] == b"kcompact.connectors.framework.api.DataError"
    assert d[H_EXC_MESSAGE] == b"AvroConverter: unknown magic byte 1"
    assert b"Traceback" in d[H_EXC_STACKTRACE] and b"def bad" not in d[H_EXC_STACKTRACE]
    assert b"in bad" in d[H_EXC_STACKTRACE]
    assert h.skipped == 1 and h.errors == 1


def test_dead_letter_delivery_failure_is_an_error():
    prod = _FakeProducer(fail="Broker: Topic authorization failed")
    dlq = DeadLetterQueue(prod, "dlq", connector="m", task_id=0)
    dlq.report(_ctx(), DataError("x"))
    with pytest.raises(Exception, match="could not write to the dead-letter topic 'dlq': Broker: "
                                        "Topic authorization failed"):
        dlq.flush()


def test_errors_log(capsys):
    import io
    buf = io.StringIO()
    values = ERRORS_CONFIG.parse({"errors.tolerance": "all", "errors.log.enable": "true",
                                  "errors.log.include.messages": "true"})
    h = ErrorHandler(values, connector="c", task_id=1, log=buf)
    h.execute(lambda: (_ for _ in ()).throw(DataError("boom")), _ctx())
    line = buf.getvalue().strip()
    assert line.startswith("kcompact: error: c-1: VALUE_CONVERTER on orders-3 offset 42: "
                           "DataError: boom (skipped)")
    assert "value=b'\\x01bad'" in line


def test_stop_interrupts_retries():
    stop = threading.Event()
    stop.set()
    values = ERRORS_CONFIG.parse({"errors.retry.timeout": "-1"})
    h = ErrorHandler(values, connector="c", task_id=0, stop=stop, sleep=lambda s: None)
    with pytest.raises(RetriableError, match="stopped while retrying"):
        h.execute(lambda: (_ for _ in ()).throw(RetriableError("down")), _ctx())
