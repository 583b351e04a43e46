# make demo : create .venv, install kcompact with every extra (and Java 17 for Spark if missing),
#             run the demo
# make test : create .venv, install kcompact with every extra, fetch Apache Kafka's jars when
#             missing (Maven, for the real-broker tier), Debian's prometheus and kcat and the
#             client matrix's clients (make clients),
#             build the user guide (make docs), run unit + integration tests (the guide's
#             examples included)
# make docs : build the user guide (docs/, mkdocs.yml) into site/; a broken link or a page
#             outside the nav fails it
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SUDO   := $(shell [ "$$(id -u)" = 0 ] || command -v sudo >/dev/null && [ "$$(id -u)" != 0 ] && echo sudo)

.PHONY: demo test docs install bytecode java maven prometheus kcat kafka-jars clients bench clean

$(BIN)/.installed: pyproject.toml setup.py reput/_native.c reput/_kafka_native.h reput/_kafka_span.h \
                   reput/_arr.h \
                   compaction/_native.c \
                   connectors/framework/_rdkafka.c connectors/apps/kv/_native.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# PYTHONWARNINGS: setuptools' note on editable installs ("folders ... with the same name as
	@# your package may take precedence") is about a stray kcompact/ folder; ours is the package's own.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -q -e '.[dev,plots,test,docs]'
	@touch $@

java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "installing Java 17 (needed by Spark)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq openjdk-17-jre-headless; }

maven:
	@command -v mvn >/dev/null 2>&1 || { \
	  echo "installing Maven (fetches Apache Kafka's jars for the real-broker tests)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq maven; }

# Debian's Prometheus server: tests/integration/test_service.py has it scrape a running kcompact
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing Prometheus (a test has it scrape kcompact --metrics)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends \
	    prometheus || echo "Prometheus could not be installed: that test will skip"; }

# Debian's kcat: tests/integration/test_kafka_endpoint.py reads the Kafka endpoint with it
kcat:
	@command -v kcat >/dev/null 2>&1 || command -v kafkacat >/dev/null 2>&1 || { \
	  echo "installing kcat (a test reads the Kafka endpoint with it)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends \
	    kcat || echo "kcat could not be installed: that test will skip"; }

install: java $(BIN)/.installed

# The package's bytecode (and the tests' helpers'), written before the tests start the hundreds
# of kcompact processes they run: with PYTHONDONTWRITEBYTECODE set (as on some CI machines) an
# editable install is never compiled to disk, and every process compiled every module again
# (kcompact --version: 0.65 s against 0.42 s). Stale files are recompiled; a no-op otherwise.
bytecode: install
	@$(BIN)/python -m compileall -q -j 0 kcompact reput compaction replication connectors tests

# Apache Kafka's jars (KCOMPACT_KAFKA_VERSION, default the pinned 3.9.1) into
# $KCOMPACT_CACHE_DIR (~/.cache/kcompact); a no-op once fetched
kafka-jars: install maven
	$(BIN)/python -m kcompact.connectors.devtools.apache_kafka fetch

# The client matrix's clients (tests/integration/test_client_matrix.py): kafka-python and
# aiokafka (PyPI, a virtualenv of their own), kafkajs (npm), kafka-go and sarama (the Go module
# proxy), rskafka (crates.io, cargo) into $KCOMPACT_CACHE_DIR/clients, once per version; a client
# that cannot be installed (no Node.js, Go or cargo, offline) is said, and its tests skip with
# the reason
clients: install
	$(BIN)/python tests/integration/clients/install.py

demo: install
	$(BIN)/kcompact demo --workdir demo-work

# NO_MKDOCS_2_WARNING: Material's banner about its successor (not a problem of this guide)
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The unit tier (CPU-bound, in-memory S3; it needs none of the integration tier's jars, clients,
# tools or the built guide, so it starts while they are set up) runs beside the integration tier (mostly waiting on
# brokers, JVMs and servers), and the integration tier runs its files on INTEGRATION_WORKERS
# pytest-xdist workers (--dist loadfile: a file's module fixtures stay on one worker; each worker
# starts its own session servers). On 2 cores the whole run takes about the integration tier's
# time, not the sum (tests/README.md has each tier's figure). Each tier prints its 30 slowest
# tests. Its output follows the integration tier's; either failing (or running no test: pytest's
# exit 5) fails `make test`.
# Three workers: with two the cores were 66-80 % busy once the unit tier had ended; with three
# 95-99 % throughout, and the run 22m54s against 24m42s-24m59s (clean clones, 2 cores).
INTEGRATION_WORKERS ?= 3
# The client matrix's clients (and Debian's prometheus and kcat when missing) install beside
# kcompact's own install: from cold caches they are the set-up's longest part (registries, a Go
# and a Rust build: about 100 s and 180 CPU-seconds), and pip leaves a core idle meanwhile.
# `make clients` installs them alone (with the venv's Python; the same cache either way). Java and
# Maven come first: apt-get installs one package set at a time.
test:
	@rm -f .unit-tests.log .setup-beside.log
	@$(MAKE) --no-print-directory java maven  # (apt-get, when missing: one at a time)
	@{ $(MAKE) --no-print-directory prometheus kcat && $(PYTHON) tests/integration/clients/install.py; \
	  } > .setup-beside.log 2>&1 & beside=$$!; \
	  $(MAKE) --no-print-directory install bytecode || { kill $$beside; exit 1; }; \
	  $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests/unit > .unit-tests.log 2>&1 & unit=$$!; \
	  echo "tests/unit: running beside the rest of the set-up and tests/integration (its output below when both are done)"; \
	  $(MAKE) --no-print-directory kafka-jars docs || { kill $$unit $$beside; exit 1; }; \
	  wait $$beside; beside_rc=$$?; cat .setup-beside.log; \
	  [ $$beside_rc -eq 0 ] || { kill $$unit; exit 1; }; \
	  $(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 -n $(INTEGRATION_WORKERS) \
	    --dist loadfile tests/integration; integration=$$?; \
	  wait $$unit; unit_rc=$$?; \
	  echo "==================== tests/unit (exit $$unit_rc) ===================="; \
	  cat .unit-tests.log; \
	  echo "tests/integration exit $$integration, tests/unit exit $$unit_rc"; \
	  [ $$integration -eq 0 ] && [ $$unit_rc -eq 0 ]

# make bench : every benchmark at BENCH_SCALE of the issues' sizes (bench/report.py) into
#              bench/out/REPORT.md with its plots; the full-size report is --scale 1 --out bench
BENCH_SCALE ?= 0.1
bench: install
	$(BIN)/python bench/report.py --scale $(BENCH_SCALE) --out bench/out

clean:
	rm -rf $(VENV) demo-work .pytest_cache site .unit-tests.log
