"""The worker: runs connectors' tasks in threads, owning their Kafka clients, converters, error
handling and metrics (Kafka Connect's ``Worker``).

``add_connector`` validates a connector's properties against its definition (the worker's,
the sink or source keys, the connector's own), resolves ``connector.class`` (short names and the
dotted names of earlier layouts through ``BUILTIN_CONNECTORS``), starts the connector and makes
its task runners: a sink's partitions are listed with a *consumer* metadata request (which never
auto-creates a topic), picked by the connector (``select_partitions``) and spread round-robin
over its tasks (sink_runner.py); a source's tasks are polled (source_runner.py), unless the
connector brings runners of its own. ``run`` starts every task and waits for them.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Mapping, TextIO

from kcompact.connectors.framework.gcmode import bulk_gc

from ..errors import ConfigError, ConnectorsError
from .api import SinkConnector, SourceConnector, TaskFailedError, TopicPartition
from .config import (ConfigDef, Importance, Type, at_least, between, load_class, non_empty,
                     one_of)
from .converters import Converter, make_converter
from .errors_handling import ERRORS_CONFIG, DeadLetterQueue, ErrorHandler
from .kafka_clients import (SINK_CONSUMER_DEFAULTS, SINK_CONSUMER_REQUIRED, KafkaSettings,
                            kafka_logger, list_partitions, list_topic_names, short_lived)
from .sink_runner import SinkTaskRunner
from .topic_watch import PartitionClaims
from .source_runner import FileOffsetStore, SourceTaskRunner

WORKER_CONFIG = (
    ConfigDef()
    .define("bootstrap.servers", Type.LIST, None, None, Importance.HIGH,
            "Kafka brokers, host:port comma-separated. Required.")
    .define("key.converter", Type.CLASS, "ByteArrayConverter", None, Importance.HIGH,
            "Default key converter of the connectors.")
    .define("value.converter", Type.CLASS, "ByteArrayConverter", None, Importance.HIGH,
            "Default value converter of the connectors.")
    .define("offset.flush.interval.ms", Type.LONG, 5_000, at_least(0), Importance.MEDIUM,
            "How often tasks flush (the store sink fsyncs its commit log and partitions) and "
            "offsets are committed; 0 = after every batch.")
    .define("offset.storage.file.filename", Type.STRING, "", None, Importance.MEDIUM,
            "File that keeps source connectors' offsets (required to run a source connector).")
    .define("plugin.path", Type.LIST, [], None, Importance.LOW,
            "Directories added to the Python path, where connector.class and converter "
            "modules are looked up.")
    .define("metrics.log.interval.ms", Type.LONG, 10_000, at_least(0), Importance.LOW,
            "How often each task's metrics (records, bytes, lag, errors) are printed on "
            "stderr; 0 = never.")
    .define("metrics.listen", Type.STRING, "", None, Importance.MEDIUM,
            "HOST:PORT where Prometheus metrics (/metrics) and a health check (/healthz) are "
            "served while the worker runs; empty = not served. No token: use a loopback or "
            "private address.")
    .define("metrics.unreachable.timeout.ms", Type.LONG, 60_000, at_least(0), Importance.LOW,
            "How long a task's brokers may stay unreachable before /healthz answers 503.")
    .define("startup.timeout.ms", Type.LONG, 10_000, at_least(100), Importance.LOW,
            "How long to wait for the brokers' metadata at start before giving up.")
    .define("listeners", Type.STRING, "http://127.0.0.1:8083", None, Importance.MEDIUM,
            "`kcompact connect standalone`: the URL where Kafka Connect's REST API is served, "
            "http://HOST:PORT or https://HOST:PORT (Apache Connect's key; port 0 picks a free "
            "one). Empty = no API. The default's port already taken is one warning line (the "
            "worker runs without the API); a port given here taken is an error. An address "
            "other than loopback needs rest.basic.auth.users.file or "
            "listeners.https.ssl.client.auth=required.")
    .define("exit.when.finished", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "`kcompact connect standalone` with connector files: true = the worker exits once "
            "no connector has work left (each task ended by itself: a sink with follow=false at "
            "its end offsets), and a task of a file's connector that fails ends it (exit 1); "
            "false = it runs until SIGTERM/SIGINT, as Apache's standalone worker, a failed task "
            "staying FAILED until restarted through the REST API. Without connector files the "
            "worker always runs until stopped.")
    .define("listeners.https.ssl.keystore.location", Type.STRING, "", None, Importance.MEDIUM,
            "https listeners: the server's key and certificate chain, a PEM file (key and "
            "certificates) or a PKCS12 file (connect_rest/tls.py; a JKS one is refused: "
            "convert it with keytool -importkeystore -deststoretype PKCS12).")
    .define("listeners.https.ssl.keystore.type", Type.STRING, "", None, Importance.LOW,
            "PEM or PKCS12 (JKS: refused); empty = told from the file.")
    .define("listeners.https.ssl.keystore.password", Type.PASSWORD, "", None, Importance.LOW,
            "The PKCS12 keystore's password.")
    .define("listeners.https.ssl.key.password", Type.PASSWORD, "", None, Importance.LOW,
            "The password of the PEM keystore's encrypted private key.")
    .define("listeners.https.ssl.keystore.certificate.chain", Type.PASSWORD, "", None,
            Importance.LOW, "Instead of a keystore file: the certificate chain, PEM text.")
    .define("listeners.https.ssl.keystore.key", Type.PASSWORD, "", None, Importance.LOW,
            "Instead of a keystore file: the private key, PEM text.")
    .define("listeners.https.ssl.truststore.location", Type.STRING, "", None, Importance.LOW,
            "The CA certificates client certificates are checked against: PEM or PKCS12.")
    .define("listeners.https.ssl.truststore.type", Type.STRING, "", None, Importance.LOW,
            "PEM or PKCS12 (JKS: refused); empty = told from the file.")
    .define("listeners.https.ssl.truststore.password", Type.PASSWORD, "", None, Importance.LOW,
            "The PKCS12 truststore's password.")
    .define("listeners.https.ssl.truststore.certificates", Type.PASSWORD, "", None,
            Importance.LOW, "Instead of a truststore file: the CA certificates, PEM text.")
    .define("listeners.https.ssl.client.auth", Type.STRING, "none",
            one_of("none", "requested", "required"), Importance.MEDIUM,
            "https listeners: none, requested (a client certificate given is checked), or "
            "required (every client must present one the truststore signed; then an address "
            "other than loopback needs no users file).")
    .define("rest.basic.auth.users.file", Type.STRING, "", None, Importance.MEDIUM,
            "The REST API's users: a file of USER:HASH lines (hashed passwords: "
            "python -m kcompact.connectors.apps.connect_rest.auth USER prints one); every "
            "request must then give one's HTTP Basic credentials.")
    .define("connectors.state.dir", Type.STRING, "", None, Importance.MEDIUM,
            "Where the connectors created or changed through the REST API are kept (one JSON "
            "file each: docs/formats/connect-state.md), so a restart brings them back. Default: "
            "<worker file without its extension>.connectors/ beside the worker file.")
    .with_passthrough("consumer.", "producer.", "admin.", "key.converter.", "value.converter.")
)

CONNECTOR_CONFIG = (
    ConfigDef()
    .define("name", Type.STRING, None, non_empty, Importance.HIGH,
            "Unique connector name (also names its consumer group, connect-<name>). Required.")
    .define("connector.class", Type.CLASS, None, non_empty, Importance.HIGH,
            "StoreSinkConnector, StoreSourceConnector, LevelDBSinkConnector, or a dotted Python "
            "path to a Connector subclass. Required.")
    .define("tasks.max", Type.INT, 1, at_least(1), Importance.HIGH,
            "Maximum number of tasks (threads); a sink's partitions are spread over them.")
    .define("key.converter", Type.CLASS, None, None, Importance.LOW,
            "Overrides the worker's key.converter.")
    .define("value.converter", Type.CLASS, None, None, Importance.LOW,
            "Overrides the worker's value.converter.")
    .merge(ERRORS_CONFIG)
    .with_passthrough("key.converter.", "value.converter.", "consumer.override.",
                      "producer.override.", "admin.override.")
)

SINK_CONFIG = (
    ConfigDef()
    .define("topics", Type.LIST, None, None, Importance.HIGH,
            "Topics to read, comma-separated. A sink connector needs topics or topics.regex.")
    .define("topics.regex", Type.STRING, "", None, Importance.HIGH,
            "Also read every topic whose whole name this Java-style regular expression matches "
            "(Connect's topics.regex; framework/topic_sets.py says where Python's re differs); "
            "internal topics (names starting with __) only when listed in topics. Resolved when "
            "the connector starts, and again while following (new topics that match are read).")
    .define("topics.exclude.regex", Type.STRING, "", None, Importance.MEDIUM,
            "Topics matched by topics.regex that this regular expression matches whole are "
            "left out (as MirrorMaker 2's topics.exclude).")
    .define("batch.max.records", Type.INT, 10_000, between(1, 1_000_000), Importance.LOW,
            "Most records handed to put() at once (consume(num_messages=...)).")
    .define("follow", Type.BOOLEAN, True, None, Importance.MEDIUM,
            "true: keep reading new records until stopped (Connect's behaviour). false: each "
            "task stops once its partitions reach the end offsets they had when it started.")
)

#: Short names of the built-in connectors.
BUILTIN_CONNECTORS = {
    "StoreSinkConnector": "kcompact.connectors.plugins.store_sink.StoreSinkConnector",
    "StoreSourceConnector": "kcompact.connectors.plugins.store_source.StoreSourceConnector",
    "LevelDBSinkConnector": "kcompact.connectors.plugins.leveldb_connector.LevelDBSinkConnector",
}
#: The dotted names of earlier layouts, still accepted in connector.class: before kcompact
#: installed under one import name (kcompact 0.1: connectors.store_sink.StoreSinkConnector), and
#: before the connectors had a folder of their own (kcompact.connectors.store_sink...).
BUILTIN_CONNECTORS.update({
    f"{prefix}{module}.{name}": BUILTIN_CONNECTORS[name]
    for prefix in ("connectors.", "kcompact.connectors.")
    for module, name in (("store_sink", "StoreSinkConnector"),
                         ("store_source", "StoreSourceConnector"),
                         ("leveldb_connector", "LevelDBSinkConnector"))
})


# ---------------------------------------------------------------------------------------------
# connectors: validation and instantiation


def connector_class(name: str) -> type:
    path = BUILTIN_CONNECTORS.get(name.strip(), name)
    cls = load_class(path, key="connector.class", kind="connector",
                     known=[k for k in BUILTIN_CONNECTORS if "." not in k])
    from .api import Connector
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ConfigError(f"connector.class: {name!r} is not a kcompact Connector subclass")
    return cls


def connector_definition(cls: type) -> ConfigDef:
    base = CONNECTOR_CONFIG.merge(SINK_CONFIG) if issubclass(cls, SinkConnector) \
        else CONNECTOR_CONFIG
    return base.merge(cls.config())


def validate_connector(props: Mapping[str, Any], *, where: str) -> tuple[type, dict[str, Any]]:
    """Resolve connector.class and validate every property against its definition."""
    if not props.get("connector.class"):
        raise ConfigError(f"{where}: missing required property 'connector.class' (e.g. "
                          "StoreSinkConnector)")
    cls = connector_class(str(props["connector.class"]))
    values = connector_definition(cls).parse(props, where=where)
    if issubclass(cls, SinkConnector) and not values.get("topics") and \
            not values.get("topics.regex"):
        raise ConfigError(f"{where}: missing required property 'topics' (comma-separated) or "
                          "'topics.regex'")
    return cls, values


def resolve_topics(consumer: Any, values: Mapping[str, Any], bootstrap: str, timeout: float
                   ) -> list[str]:
    """A sink's topics: ``topics``, then those ``topics.regex`` matches among the cluster's
    (framework/topic_sets.py); a pattern that matches nothing is an error naming it."""
    from .topic_sets import match_topics
    named = list(values.get("topics") or [])
    regex, exclude = values.get("topics.regex") or "", values.get("topics.exclude.regex") or ""
    if not regex:
        return match_topics((), named, None, exclude)
    available = list_topic_names(consumer, bootstrap, timeout)
    topics = match_topics(available, named, regex, exclude)
    if len(topics) == len(named) and not named:
        raise ConnectorsError(f"topics.regex {regex!r} matches no topic on {bootstrap} ("
                              f"{sum(1 for t in available if not t.startswith('__'))} topics, "
                              "internal ones left out"
                              + (f", topics.exclude.regex {exclude!r}" if exclude else "") + ")")
    return topics


class Worker:
    """Runs connectors in this process until they finish or :meth:`stop` is called."""

    def __init__(self, props: Mapping[str, Any], *, where: str = "worker",
                 log: TextIO | None = None, command: str | None = None):
        self.config = WORKER_CONFIG.parse(props, where=where)
        self.where = where
        #: the running command (``kcompact_info``, the metrics endpoint's log lines)
        self.command = command or where
        if not self.config["bootstrap.servers"]:
            raise ConfigError(f"{where}: missing required property 'bootstrap.servers'")
        for d in self.config["plugin.path"]:
            if d not in sys.path:
                sys.path.insert(0, d)
        self.bootstrap = ",".join(self.config["bootstrap.servers"])
        self.log = log if log is not None else sys.stderr
        self.stop_event = threading.Event()
        self.runners: list[SinkTaskRunner | SourceTaskRunner] = []
        self.connectors: list[Any] = []
        self._offsets: FileOffsetStore | None = None
        self._ops = None
        #: the stop events of connectors that have their own (add_connector's ``stop``)
        self._stops: dict[str, threading.Event] = {}
        #: such a connector's tasks' own stop events (set with its own), and what makes one
        #: of its task runners again (:meth:`restart_task`)
        self._task_stops: dict[str, list[threading.Event]] = {}
        self._task_makers: dict[str, Callable[[int, threading.Event], Any]] = {}

    @property
    def ops(self):
        """The worker's metrics and health checks (kcompact.replication.ops.Ops), served on
        ``metrics.listen`` while it runs; an application may add its own to it."""
        if self._ops is None:
            from kcompact.replication.ops import Ops, check_listen
            from .metrics import worker_metrics
            check_listen(self.config["metrics.listen"] or None)
            self._ops = Ops(self.command)
            worker_metrics(self._ops, self,
                           self.config["metrics.unreachable.timeout.ms"] / 1000)
        return self._ops

    def close_ops(self) -> None:
        """Close the metrics' probes (after the metrics server stopped)."""
        if self._ops is not None:
            self._ops.close()

    # -- configuration -------------------------------------------------------------------------

    def _converter(self, role: str, values: Mapping[str, Any], props: Mapping[str, Any]
                   ) -> Converter:
        name = values.get(f"{role}.converter") or self.config[f"{role}.converter"]
        conf = ConfigDef.with_prefix(self.config, f"{role}.converter.")
        conf.update(ConfigDef.with_prefix(props, f"{role}.converter."))
        return make_converter(name, conf, is_key=role == "key")

    def _settings(self, kind: str, base: Mapping[str, Any], values: Mapping[str, Any],
                  override_origin: Callable[[str], str] | None) -> KafkaSettings:
        s = KafkaSettings(dict(base, **{"bootstrap.servers": self.bootstrap}))
        s.update(ConfigDef.with_prefix(self.config, f"{kind}."),
                 lambda k: f"{kind}.{k} (worker)")
        s.update(ConfigDef.with_prefix(values, f"{kind}.override."),
                 override_origin or (lambda k: f"{kind}.override.{k}"))
        return s

    def _errors(self, name: str, task_id: int, values: Mapping[str, Any],
                stop: threading.Event | None = None) -> ErrorHandler:
        dlq = None
        topic = values.get("errors.deadletterqueue.topic.name")
        if topic:
            if values.get("errors.tolerance") != "all":
                raise ConfigError("errors.deadletterqueue.topic.name needs errors.tolerance=all "
                                  "(with none, the first bad record stops the task)")
            from confluent_kafka import KafkaException, Producer
            from confluent_kafka.admin import AdminClient
            ps = self._settings("producer", {"enable.idempotence": True}, values, None)
            admin_s = self._settings("admin", {}, values, None)
            try:
                admin = AdminClient(dict(admin_s.conf, logger=kafka_logger()))
            except KafkaException as e:
                raise admin_s.explain(e, "Kafka admin") from None
            DeadLetterQueue.ensure_topic(
                admin, topic, values["errors.deadletterqueue.topic.replication.factor"],
                timeout=self.config["startup.timeout.ms"] / 1000)
            try:
                producer = Producer(dict(ps.conf, logger=kafka_logger()))
            except KafkaException as e:
                raise ps.explain(e, "Kafka producer") from None
            dlq = DeadLetterQueue(producer, topic, connector=name, task_id=task_id,
                                  context_headers=values[
                                      "errors.deadletterqueue.context.headers.enable"])
        return ErrorHandler(values, connector=name, task_id=task_id, dlq=dlq, log=self.log,
                            stop=stop if stop is not None else self.stop_event)

    def add_connector(self, props: Mapping[str, Any], *, where: str = "connector",
                      consumer_origin: Callable[[str], str] | None = None,
                      producer_origin: Callable[[str], str] | None = None,
                      stop: threading.Event | None = None) -> list[Any]:
        """Validate, start the connector and create (not yet start) its task runners.
        ``stop``: an event of the connector's own that stops its tasks alone (the REST API's
        pause, stop, restart and delete: :meth:`remove_connector`); :meth:`stop` sets it too.
        Without one, the connector's tasks stop with the worker's."""
        cls, values = validate_connector(props, where=where)
        name = values["name"]
        if any(getattr(c, "name", None) == name for c in self.connectors):
            raise ConfigError(f"{where}: a connector named {name!r} is already defined")
        stop = stop if stop is not None else self.stop_event
        if stop is not self.stop_event:
            self._stops[name] = stop
            if self.stop_event.is_set():
                stop.set()
        try:
            return self._add_connector(cls, values, props, where, consumer_origin,
                                       producer_origin, stop)
        except BaseException:
            self._stops.pop(name, None)
            self._task_stops.pop(name, None)
            self._task_makers.pop(name, None)
            for c in [c for c in self.connectors if getattr(c, "name", None) == name]:
                self.connectors.remove(c)  # started, then its partitions or tasks failed
                try:
                    c.stop()
                except Exception:  # noqa: BLE001 - the start's error is the one to report
                    pass
            raise

    def _add_connector(self, cls: type, values: dict[str, Any], props: Mapping[str, Any],
                       where: str, consumer_origin: Callable[[str], str] | None,
                       producer_origin: Callable[[str], str] | None,
                       stop: threading.Event) -> list[Any]:
        from confluent_kafka import Consumer, KafkaException
        name = values["name"]
        # converters are validated before anything touches Kafka or the store
        self._converter("key", values, props).close()
        self._converter("value", values, props).close()
        connector = cls()
        connector.name = name
        runners: list[Any] = []
        timeout = self.config["startup.timeout.ms"] / 1000
        flush_ms = self.config["offset.flush.interval.ms"]
        if isinstance(connector, SinkConnector):
            # Kafka first: an unknown topic or a dead broker must fail before the connector
            # creates anything (a store, a dead-letter topic).
            task_cls = connector.task_class()
            base = dict(SINK_CONSUMER_DEFAULTS, **getattr(task_cls, "DEFAULT_CONSUMER_CONFIG", {}))
            base["group.id"] = f"connect-{name}"
            settings = self._settings("consumer", base, values, consumer_origin)
            settings.require(SINK_CONSUMER_REQUIRED, "the worker (it assigns partitions itself)")
            settings.require(getattr(task_cls, "REQUIRED_CONSUMER_CONFIG", {}), cls.__name__)
            try:
                probe = Consumer(short_lived(dict(settings.conf, logger=kafka_logger())))
            except KafkaException as e:
                raise settings.explain(e, "Kafka consumer") from None
            try:
                values["topics"] = resolve_topics(probe, values, self.bootstrap, timeout)
                by_topic = list_partitions(probe, values["topics"], self.bootstrap, timeout)
            finally:
                probe.close()
            connector.kafka_conf = dict(settings.conf)
            connector.start(values)
            self.connectors.append(connector)
            task_props = connector.task_configs(values["tasks.max"])[:values["tasks.max"]]
            # every topic checked before the connector creates anything for any of them
            selected = {t: connector.select_partitions(t, by_topic[t]) for t in values["topics"]}
            connector.partitions_selected(selected)
            tps = [TopicPartition(t, p) for t in values["topics"] for p in selected[t]]
            n = len(task_props)
            # topics read whole are watched for new partitions while following, by every task:
            # what they find is spread over the tasks by one PartitionClaims; every topic a
            # task reads is watched by it for deletion and re-creation (topic_watch.py)
            whole = {t: len(by_topic[t]) for t in values["topics"]
                     if sum(1 for tp in tps if tp.topic == t) == len(by_topic[t])}
            claims, announced = PartitionClaims(n, len(tps)), {}

            def make_task(i: int, task_stop: threading.Event) -> SinkTaskRunner:
                conf = dict(settings.conf, **{"client.id": f"kcompact-{name}-{i}"})
                return SinkTaskRunner(
                    connector=name, task_id=i, task=task_cls(), props=task_props[i],
                    assignment=tps[i::n], consumer_conf=conf,
                    key_converter=self._converter("key", values, props),
                    value_converter=self._converter("value", values, props),
                    errors=self._errors(name, i, values, task_stop), follow=values["follow"],
                    batch_max=values["batch.max.records"], flush_interval_ms=flush_ms,
                    stop=task_stop, startup_timeout=timeout, settings=settings,
                    whole_topics=whole,
                    topic_pattern=(values["topics.regex"], values["topics.exclude.regex"])
                    if values.get("topics.regex") else None,
                    claims=claims, announced=announced, topics=values["topics"])
            runners = self._make_tasks(name, len(task_props), make_task, stop)
        elif isinstance(connector, SourceConnector):
            if values.get("errors.deadletterqueue.topic.name"):
                raise ConfigError(f"{where}: errors.deadletterqueue.topic.name applies to sink "
                                  "connectors only (as in Kafka Connect)")
            make_runners = getattr(connector, "make_runners", None)
            if make_runners is not None:
                # The connector produces and keeps its progress itself (the store source:
                # transactions, progress in the store), so no offsets file is needed.
                settings = self._settings("producer", {}, values, producer_origin)
                connector.start(values)
                self.connectors.append(connector)
                runners = make_runners(name=name, props=values, settings=settings,
                                       stop=stop, startup_timeout=timeout,
                                       log=self.log)
                for r in runners:
                    r.connector_name = name
                self.runners.extend(runners)
                return runners
            path = self.config["offset.storage.file.filename"]
            if not path:
                raise ConfigError("the worker needs offset.storage.file.filename to run source "
                                  f"connector {name!r}")
            connector.start(values)
            self.connectors.append(connector)
            task_props = connector.task_configs(values["tasks.max"])[:values["tasks.max"]]
            if self._offsets is None:
                self._offsets = FileOffsetStore(path)
            settings = self._settings("producer", {"enable.idempotence": True}, values, None)

            def make_source(i: int, task_stop: threading.Event) -> SourceTaskRunner:
                return SourceTaskRunner(
                    connector=name, task_id=i, task=connector.task_class()(),
                    props=task_props[i], producer_conf=settings.conf,
                    key_converter=self._converter("key", values, props),
                    value_converter=self._converter("value", values, props),
                    errors=self._errors(name, i, values, task_stop), offsets=self._offsets,
                    flush_interval_ms=flush_ms, stop=task_stop, settings=settings)
            runners = self._make_tasks(name, len(task_props), make_source, stop)
        else:
            raise ConfigError(f"{where}: {cls.__name__} is neither a sink nor a source connector")
        for r in runners:
            r.connector_name = name
        self.runners.extend(runners)
        return runners

    def _make_tasks(self, name: str, n: int, make: Callable[[int, threading.Event], Any],
                    stop: threading.Event) -> list[Any]:
        """The connector's ``n`` task runners. A connector with a stop event of its own gets
        one per task too (set with its own), so that one task can restart alone."""
        if stop is self.stop_event:
            return [make(i, stop) for i in range(n)]
        events = [threading.Event() for _ in range(n)]
        if stop.is_set():
            for ev in events:
                ev.set()
        self._task_stops[name], self._task_makers[name] = events, make
        return [make(i, ev) for i, ev in enumerate(events)]

    # -- running -------------------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_event.set()
        for ev in list(self._stops.values()):
            ev.set()
        for events in list(self._task_stops.values()):
            for ev in events:
                ev.set()

    def restart_task(self, name: str, task_id: int) -> Any | None:
        """Stop task ``task_id`` of connector ``name`` (after its current batch, flushing it)
        and make it again, not started (same config and partitions); the other tasks go on.
        None when the connector's tasks cannot restart alone (one that makes its own runners,
        or added without a stop event of its own)."""
        make, events = self._task_makers.get(name), self._task_stops.get(name)
        if make is None or events is None or not 0 <= task_id < len(events):
            return None
        old = self.connector_runners(name)[task_id]
        events[task_id].set()
        if old.thread.ident is not None:
            old.thread.join()
        ev = threading.Event()
        if self._stops[name].is_set():
            ev.set()
        events[task_id] = ev
        new = make(task_id, ev)
        new.connector_name = name
        self.runners[self.runners.index(old)] = new
        return new

    def connector_runners(self, name: str) -> list[Any]:
        """The task runners of connector ``name`` (in task order)."""
        return [r for r in self.runners if getattr(r, "connector_name", None) == name]

    def remove_connector(self, name: str) -> list[Any]:
        """Stop connector ``name``'s tasks (after their current batch, flushing them), wait for
        them and stop the connector; returns its runners (their ``failure``). Only a connector
        added with a ``stop`` event of its own can be removed alone."""
        ev = self._stops.pop(name, None)
        if ev is None:
            raise ConnectorsError(f"connector {name!r} was not added with a stop event of its "
                                  "own; it stops with the worker")
        ev.set()
        for t in self._task_stops.pop(name, []):
            t.set()
        self._task_makers.pop(name, None)
        runners = self.connector_runners(name)
        for r in runners:
            if r.thread.ident is not None:  # started
                r.thread.join()
        self.runners = [r for r in self.runners if r not in runners]
        for c in [c for c in self.connectors if getattr(c, "name", None) == name]:
            self.connectors.remove(c)
            try:
                c.stop()
            except Exception:  # noqa: BLE001 - the connector is gone either way
                pass
        return runners

    def stopped_topics(self) -> dict[str, str]:
        """The topics sink tasks stopped while the others went on (deleted or recreated while
        followed: sink_runner.py) -> why."""
        out: dict[str, str] = {}
        for r in self.runners:
            out.update(r.metrics.stopped)
        return out

    def refused_partitions(self) -> dict:
        """The partitions sink tasks refused (damaged in the store: sink_runner.py) -> why."""
        out: dict = {}
        for r in self.runners:
            out.update(getattr(r.metrics, "refused", {}))
        return out

    def run(self, on_tick: Callable[["Worker"], None] | None = None, tick: float = 0.5) -> None:
        """Start every task and wait until all have ended (or one failed: the others are then
        stopped, and the failure is raised as one line naming the task). The garbage collector
        runs less often meanwhile (connectors/framework/gcmode.py)."""
        server = None
        if self.config["metrics.listen"]:
            from kcompact.replication.ops import start_ops
            server = start_ops(self.ops, self.config["metrics.listen"],
                               lambda m: print(f"kcompact: {m}", file=self.log, flush=True))
        try:
            with bulk_gc():
                self._run_tasks(on_tick, tick)
        finally:
            if server is not None:
                server.stop()
            if self._ops is not None:
                self._ops.close()

    def _run_tasks(self, on_tick: Callable[["Worker"], None] | None, tick: float) -> None:
        interval = self.config["metrics.log.interval.ms"] / 1000
        last_log = time.monotonic()
        for r in self.runners:
            r.start()
        try:
            while any(r.alive for r in self.runners):
                for r in self.runners:
                    r.thread.join(timeout=tick / max(1, len(self.runners)))
                if any(r.failure is not None for r in self.runners):
                    self.stop_event.set()
                if on_tick is not None:
                    on_tick(self)
                elif interval and time.monotonic() - last_log >= interval:
                    last_log = time.monotonic()
                    for r in self.runners:
                        print(f"kcompact: {r.metrics.summary()}", file=self.log, flush=True)
        finally:
            self.stop_event.set()
            for r in self.runners:
                r.thread.join()
            for c in self.connectors:
                try:
                    c.stop()
                except Exception:  # noqa: BLE001
                    pass
        for r in self.runners:
            if r.failure is not None:
                raise_task_failure(r)


def raise_task_failure(runner: Any) -> None:
    """Raise a failed task runner's ``failure`` as the one line a command reports."""
    e = runner.failure
    if isinstance(e, (ConnectorsError, KeyboardInterrupt)):
        raise e
    from kcompact.reput import ReputError
    if isinstance(e, (ReputError, OSError)):
        raise TaskFailedError(f"task {runner.metrics.name}: {e}") from e
    raise TaskFailedError(f"task {runner.metrics.name} failed: {type(e).__name__}: {e}") from e
