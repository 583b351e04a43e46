"""Every ``bash`` and ``python`` example of README.md and of the user guide (docs/) runs as written.

One test per page: its runnable blocks, in order, in one bash session (a ``python`` block is fed
to this interpreter through a quoted here-document, so the page's ``export``s and files are
shared). What a page assumes is provided the way a user would have it (docs/development.md,
"The guide and its examples"):

* placeholders mapped to temporary ones (:func:`substitute`): ``/data``, ``/etc/kcompact`` and
  ``/var/lib/kcompact`` under the test's directory, ``10.0.0.5`` to 127.0.0.1, every port the
  examples name to a free one on 127.0.0.1, ``make demo`` to the command it runs once installed
  (once a module: a later page gets a copy of the first demo's demo-work);
  on a page that uses ``s3://``, the buckets and ``AWS_*=...`` to this session's SeaweedFS;
* unless the page starts its own (``kcompact broker --port 9092``), an embedded Tansu broker on
  the page's 9092 with the topics the pages use (:data:`SEED`);
* ``kcompact`` on PATH is a shim (:data:`SHIM`) that runs a command which does not end by itself
  the way a user runs it in another terminal: a server (``serve``, ``kv serve``, ``broker``) in
  the background until the page ends, once its port answers; a ``--follow`` command or
  ``connect standalone`` until it stops by itself or for a few seconds, then SIGTERM (it must
  exit 0). Every other command runs as it is.

A block preceded by ``_Not run by the example tests: <reason>_`` is skipped (the reason is in the
page); a page whose runnable blocks need a real Apache Kafka (``--engine kafka``) skips when the
real-broker tier cannot run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from brokers import apache_kafka_unavailable

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
SKIP = re.compile(r"^_Not run by the example tests: (.+)_$")
#: The ports the examples name; each page gets free ones in their place.
PORTS = (9092, 9093, 9094, 8470, 8471, 8472, 9470, 9471, 8083, 8443)
PAGE_TIMEOUT = 1500
#: Topics the pages assume (Getting started creates ``orders`` the same way): name ->
#: (partitions, records as (key, value)).
SEED = {
    "orders": (3, [(f"customer-{i % 100}", f'{{"order": {i}}}') for i in range(1000)]
               + [("customer-7", None)]),
    "users": (1, [(f"user-{i}", json.dumps({"name": f"user {i}"})) for i in range(100)]),
    "app-billing-changelog": (1, [(f"invoice-{i}", f"{i}") for i in range(20)]),
    "app-test-state": (1, [(f"k-{i}", f"{i}") for i in range(20)]),
}


@dataclass
class Block:
    lang: str
    code: str
    line: int
    skip: str | None = None


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)

    @property
    def runnable(self) -> list[Block]:
        return [b for b in self.blocks if b.skip is None]

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def parse(path: Path) -> Page:
    """The fenced blocks of a markdown page that are examples (bash, python), each with the
    reason it is not run when the paragraph before it gives one."""
    page = Page(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    para: list[str] = []          # the paragraph being read
    last_text = ""                # the last paragraph before the next block
    while i < len(lines):
        m = re.match(r"^(\s*)```\s*([\w+-]*)", lines[i])
        if not m:
            if lines[i].strip():
                para.append(lines[i].strip())
            elif para:
                last_text, para = " ".join(para), []
            i += 1
            continue
        if para:
            last_text, para = " ".join(para), []
        indent, lang = m.group(1), m.group(2).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^{indent}```\s*$", lines[i]):
            body.append(lines[i][len(indent):])
            i += 1
        i += 1
        if lang in RUNNABLE:
            why = SKIP.match(last_text)
            page.blocks.append(Block(RUNNABLE[lang], "\n".join(body) + "\n", start + 1,
                                     why.group(1) if why else None))
        last_text = ""
    return page


def pages() -> list[Page]:
    paths = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [p for p in map(parse, paths) if p.blocks]


PAGES = pages()


def test_the_pages_have_examples_and_say_why_one_is_not_run():
    names = {p.name for p in PAGES}
    for must in ("README.md", "docs/getting-started.md", "docs/mirror.md", "docs/kv.md",
                 "docs/replication.md", "docs/restore.md", "docs/s3.md", "docs/spark.md",
                 "docs/connectors.md", "docs/operations.md", "docs/python-api.md"):
        assert must in names, f"{must} has no bash or python example"
    for p in PAGES:
        for b in p.blocks:
            assert b.skip is None or len(b.skip.split()) >= 3, f"{p.name}:{b.line}: say why"


# -- mapping the placeholders ------------------------------------------------------------------


@dataclass
class Places:
    root: Path
    ports: dict[int, int]
    s3: dict[str, str] | None = None   # bucket, prefix, endpoint port, key id, secret


def substitute(code: str, places: Places) -> str:
    """The page's placeholders replaced with this run's (module docstring)."""
    s3 = places.s3
    if s3 is not None:
        for bucket in ("data", "backup", "kcompact-dev"):
            code = code.replace(f"s3://{bucket}/", f"s3://{s3['bucket']}/{s3['prefix']}/{bucket}/")
        code = code.replace("AWS_ACCESS_KEY_ID=...", f"AWS_ACCESS_KEY_ID={s3['key']}")
        code = code.replace("AWS_SECRET_ACCESS_KEY=...", f"AWS_SECRET_ACCESS_KEY={s3['secret']}")
        code = code.replace("127.0.0.1:8333", f"127.0.0.1:{s3['port']}")
    # the demo runs once per session (test_demo.py runs it as a whole): a later page's
    # demo-work is a copy of the first's ($KC_DOC_DEMO, kept once a demo succeeded)
    code = re.sub(r"^make demo\b.*$",
                  'if [ -d "$KC_DOC_DEMO" ]; then cp -a "$KC_DOC_DEMO" demo-work; else '
                  "kcompact demo --workdir demo-work --records 4000 && "
                  'cp -a demo-work "$KC_DOC_DEMO.part" && mv "$KC_DOC_DEMO.part" "$KC_DOC_DEMO"; fi',
                  code, flags=re.M)
    code = re.sub(r"^make test\b.*$", ": make test is the run these tests belong to", code,
                  flags=re.M)
    code = code.replace(".venv/bin/", f"{BIN}/")
    for path in ("/var/lib/kcompact", "/etc/kcompact", "/data"):
        code = re.sub(rf"(?<![\w./:-]){re.escape(path)}(?=[/\s'\"]|$)",
                      f"{places.root}{path}", code, flags=re.M)
    code = code.replace("10.0.0.5", "127.0.0.1")
    code = re.sub(r"(?<![\d.])(" + "|".join(map(str, PORTS)) + r")(?!\d)",
                  lambda m: str(places.ports[int(m.group(1))]), code)
    return code


def background_kcompact(code: str) -> str:
    """``kcompact ... &``: the shim backgrounds what does not end by itself and waits until it
    answers, so the next line finds it ready (a bare ``&`` would race)."""
    return re.sub(r"^(\s*kcompact\b[^#\n]*?)\s&(\s*#.*)?$", r"\1\2", code, flags=re.M)


# -- the kcompact shim ----------------------------------------------------------------------------


SHIM = r'''#!{python}
"""kcompact as the doc examples run it (tests/integration/test_doc_examples.py)."""
import os, re, signal, socket, subprocess, sys, time

REAL = {real!r}
PIDS = os.environ["KC_DOC_PIDS"]
LOGS = os.environ["KC_DOC_LOGS"]
args = sys.argv[1:]


def record(p):
    with open(PIDS, "a") as f:
        f.write(f"{{p.pid}}\n")


def flag(name):
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def answers(hostport):
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=1):
            return True
    except OSError:
        return False


def rest_listener():
    """connect standalone's REST API (a worker file with listeners=http://HOST:PORT)."""
    if args[:2] != ["connect", "standalone"] or len(args) < 3:
        return None
    try:
        m = re.search(r"^listeners\s*=\s*https?://([^/\s]+)", open(args[2]).read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


rest = rest_listener()
server = args[:1] in (["broker"], ["serve"]) or args[:2] == ["kv", "serve"] or bool(rest)
follow = "--follow" in args or args[:2] == ["connect", "standalone"]
if server:
    log_path = os.path.join(LOGS, f"{{args[0]}}-{{time.monotonic_ns()}}.log")
    log = open(log_path, "w")
    p = subprocess.Popen([REAL, *args], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    record(p)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if p.poll() is not None:
            sys.stdout.write(open(log_path).read())
            sys.exit(p.returncode or 1)
        if args[0] == "broker":
            ready = "listening on" in open(log_path).read()
        elif rest:
            ready = answers(rest)
        else:
            ready = all(answers(hp) for hp in
                        flag("--listen") + flag("--kafka-listen") + flag("--metrics"))
        if ready:
            print(f"[doc examples: kcompact {{args[0]}} running in the background, log {{log_path}}]")
            sys.exit(0)
        time.sleep(0.1)
    sys.exit(f"kcompact {{' '.join(args)}} did not become ready: {{open(log_path).read()[-2000:]}}")
elif follow:
    p = subprocess.Popen([REAL, *args], stdin=subprocess.DEVNULL, start_new_session=True)
    record(p)
    try:
        p.wait(8 if "--follow" in args else 120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(120)
    sys.exit(p.returncode)
else:
    os.execv(REAL, [REAL, *args])
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seed(bootstrap: str) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for topic, (parts, _) in SEED.items():
        admin.create_topics([NewTopic(topic, parts)])[topic].result(60)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for topic, (_, rows) in SEED.items():
        for key, value in rows:
            producer.produce(topic, key=key, value=value)
    assert producer.flush(60) == 0


def _stop_all(pids_file: Path) -> None:
    if not pids_file.exists():
        return
    pids = [int(x) for x in pids_file.read_text().split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            import time
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def script(page: Page, places: Places) -> str:
    # a function, not only PATH: `source .venv/bin/activate` puts the real one first on PATH
    out = ["set -eo pipefail", f'export PATH="{places.root}/bin:{BIN}:$PATH"',
           f'kcompact() {{ "{places.root}/bin/kcompact" "$@"; }}']
    for b in page.runnable:
        code = substitute(b.code, places)
        out.append(f"echo '>>> {page.name}:{b.line}' >&2")
        if b.lang == "python":
            out.append(f"{sys.executable} - <<'KC_DOC_PYTHON_EOF'\n{code}KC_DOC_PYTHON_EOF")
        else:
            out.append(background_kcompact(code))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> Path:
    """Where the first page's finished demo-work is kept for the next pages' ``make demo``."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.mark.parametrize("page", [p for p in PAGES if p.runnable], ids=lambda p: p.name)
def test_page_examples_run(page: Page, tmp_path, request, demo_cache):
    from kcompact.connectors.devtools.broker import EmbeddedBroker

    text = "".join(b.code for b in page.runnable)
    if "--engine kafka" in text:
        why = apache_kafka_unavailable()
        if why is not None:
            pytest.skip(f"{page.name} starts a real Apache Kafka: {why}")
    root = tmp_path / "root"
    for d in ("data", "etc/kcompact", "var/lib/kcompact", "bin", "logs", "work"):
        (root / d).mkdir(parents=True)
    places = Places(root, {p: _free_port() for p in PORTS})
    env = dict(os.environ, KC_DOC_PIDS=str(root / "pids"), KC_DOC_LOGS=str(root / "logs"),
               KC_DOC_DEMO=str(demo_cache / "demo-work"),
               KCOMPACT_CACHE_DIR=str(root / "cache"), TMPDIR=str(tmp_path),
               PYTHONUNBUFFERED="1")
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    if "s3://" in text:
        make = request.getfixturevalue("s3_store_url")
        server = make.server
        places.s3 = {"bucket": make.bucket, "prefix": f"doc-{uuid.uuid4().hex[:8]}",
                     "port": server.endpoint.rsplit(":", 1)[1], "key": server.env()[
                         "AWS_ACCESS_KEY_ID"], "secret": server.env()["AWS_SECRET_ACCESS_KEY"]}
        env.update(server.env())
    shim = root / "bin" / "kcompact"
    shim.write_text(SHIM.format(python=sys.executable, real=str(BIN / "kcompact")))
    shim.chmod(0o755)
    (root / "page.sh").write_text(script(page, places))

    broker = None
    if not re.search(r"kcompact broker --port 9092\b", text):
        broker = EmbeddedBroker(places.ports[9092]).start()
    try:
        if broker is not None:
            _seed(broker.bootstrap_servers)
        p = subprocess.run(["bash", str(root / "page.sh")], cwd=root / "work", env=env,
                           capture_output=True, text=True, timeout=PAGE_TIMEOUT,
                           stdin=subprocess.DEVNULL)
    finally:
        _stop_all(root / "pids")
        if broker is not None:
            broker.stop()
    if p.returncode != 0:
        logs = "".join(f"\n--- {f.name}\n{f.read_text()[-1500:]}" for f in
                       sorted((root / "logs").iterdir()))
        where = [ln for ln in p.stderr.splitlines() if ln.startswith(">>> ")]
        pytest.fail(f"{where[-1] if where else page.name}: exit {p.returncode}\n"
                    f"--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}{logs}",
                    pytrace=False)


def test_substitute_maps_every_placeholder(tmp_path):
    places = Places(tmp_path, {p: 40000 + i for i, p in enumerate(PORTS)},
                    {"bucket": "b", "prefix": "x", "port": "1234", "key": "k", "secret": "s"})
    out = substitute("kcompact serve --store /data/store --listen 10.0.0.5:8470 "
                     "--token-file /etc/kcompact/token\n"
                     "kcompact mirror --bootstrap-servers localhost:9092 --store s3://data/kc\n"
                     "export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...\n"
                     "echo 1700000009092 http://127.0.0.1:8333\nmake demo\n", places)
    assert f"--store {tmp_path}/data/store --listen 127.0.0.1:40003" in out
    assert f"--token-file {tmp_path}/etc/kcompact/token" in out
    assert "localhost:40000 --store s3://b/x/data/kc" in out
    assert "AWS_ACCESS_KEY_ID=k AWS_SECRET_ACCESS_KEY=s" in out
    assert "echo 1700000009092 http://127.0.0.1:1234" in out
    assert "kcompact demo --workdir demo-work --records 4000" in out
    assert background_kcompact("kcompact broker --port 1 &   # note\nx & y\n") == \
        "kcompact broker --port 1   # note\nx & y\n"


def test_parse_finds_blocks_and_skip_reasons(tmp_path):
    md = tmp_path / "p.md"
    md.write_text("# t\n\n```bash\necho a\n```\n\n_Not run by the example tests: it needs "
                  "systemd here._\n\n```python\nprint(1)\n```\n\n```text\nno\n```\n")
    page = parse(md)
    assert [(b.lang, b.skip) for b in page.blocks] == [
        ("bash", None), ("python", "it needs systemd here.")]
    assert shutil.which("bash")
