"""The user guide's reference pages, generated from the code so that they cannot drift from it.

* :func:`cli_page`: every ``kcompact`` command and flag, walked from the argparse parser of
  connectors/cli.py (a flag added there appears here with its help text and default);
* :func:`topic_configs_page`: every topic config, from ``kcompact.reput.config.TOPIC_CONFIG``;
* :func:`connect_page`: every worker, connector, sink, error-handling, plugin and converter
  property, from their ``ConfigDef`` tables;
* :func:`env_page`: every ``KCOMPACT_*`` variable, from ``kcompact.reput.env``.

The guide's MkDocs hook (docs/hooks.py) adds :data:`PAGES` to the site at build time; the unit
test tests/unit/test_docs_reference.py checks that every flag, key and variable has its doc.
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterator

from kcompact.reput.configdef import ConfigDef

__all__ = ["PAGES", "cli_commands", "cli_page", "config_tables", "connect_page", "env_page",
           "topic_configs_page"]

_GENERATED = ("<!-- generated from the code by connectors/devtools/reference.py at build time; "
              "edit the code, not this page -->\n")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------
# the command line


def cli_commands(parser: argparse.ArgumentParser | None = None
                 ) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """(command words, its parser, its one-line help) for every command, depth first."""
    if parser is None:
        from kcompact.connectors.cli import build_parser
        parser = build_parser()

    def walk(p: argparse.ArgumentParser, words: str, help_text: str):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words == "kcompact":
            yield words, p, help_text
        for action in subs:
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            for name, sub in action.choices.items():
                yield from walk(sub, f"{words} {name}", helps.get(name, ""))

    yield from walk(parser, "kcompact", parser.description or "")


def _flag_rows(p: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    rows = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.option_strings:
            name = ", ".join(f"`{s}`" for s in a.option_strings)
            if a.nargs != 0 and (a.metavar or not a.choices):
                name += f" `{a.metavar or a.dest.upper()}`"
        else:
            name = f"`{a.metavar or a.dest}`"
        if a.choices and not isinstance(a.choices, dict):
            name += " (" + " \\| ".join(f"`{c}`" for c in a.choices) + ")"
        default = a.default
        if a.required or not a.option_strings:
            dtext = "required"
        elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                            argparse._VersionAction)) or default in (None, [], argparse.SUPPRESS):
            dtext = ""
        else:
            dtext = f"`{default}`"
        if isinstance(a, argparse._AppendAction):
            dtext = (dtext + " " if dtext and default not in ([], None) else "") + "repeatable"
        rows.append((name, dtext, a.help or ""))
    return rows


def cli_page() -> str:
    out = [_GENERATED, "# Command line reference\n",
           "Every command and flag of `kcompact`, generated from its argparse parser "
           "(`kcompact COMMAND --help` prints the same). `python -m kcompact` is the same "
           "program. Exit codes: 0 success; 1 a runtime error, printed as one line "
           "`kcompact: error: ...` naming what is wrong (`verify` also exits 1 when it finds "
           "corruption or a difference); 2 a usage error; 3 a mirror or `connect standalone` "
           "that stopped a deleted or recreated topic; 130 after Ctrl-C. "
           "`KCOMPACT_DEBUG=1` prints tracebacks ([environment](environment.md)).\n"]
    for words, p, help_text in cli_commands():
        depth = words.count(" ")
        out.append(f"\n{'#' * min(2 + (depth > 1), 3)} `{words}`\n")
        if help_text:
            out.append(f"{help_text[0].upper()}{help_text[1:]}.\n" if not
                       help_text.endswith(".") else f"{help_text}\n")
        usage = p.format_usage().strip().removeprefix("usage: ")
        out.append(f"\n```text\n{usage}\n```\n")
        rows = _flag_rows(p)
        if rows:
            out.append("\n| flag | default | what it does |\n|---|---|---|")
            out.extend(f"| {n} | {_cell(d)} | {_cell(h)} |" for n, d, h in rows)
            out.append("")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# configs


def _table(cdef: ConfigDef) -> str:
    return cdef.markdown_table() + "\n"


def config_tables() -> list[tuple[str, str, ConfigDef]]:
    """(title, introduction, table) of every Connect-style ConfigDef, in the page's order."""
    from kcompact.connectors.framework.converters import (AvroConverter, ByteArrayConverter,
                                                          JsonConverter, StringConverter)
    from kcompact.connectors.framework.worker import (CONNECTOR_CONFIG, SINK_CONFIG,
                                                      WORKER_CONFIG)
    from kcompact.connectors.plugins.leveldb_connector import LEVELDB_SINK_CONFIG
    from kcompact.connectors.plugins.store_sink import STORE_SINK_CONFIG
    from kcompact.connectors.plugins.store_source import STORE_SOURCE_CONFIG

    def passthrough(cdef: ConfigDef) -> str:
        if not cdef.passthrough:
            return ""
        return (" Keys starting with " + ", ".join(f"`{p}`" for p in cdef.passthrough)
                + " are passed through to the component they name (librdkafka for "
                "`consumer.`/`producer.`/`admin.` and their `.override.` forms; the converter "
                "for `key.converter.`/`value.converter.`).")

    return [
        ("Worker", "The file given first to `kcompact connect standalone`." +
         passthrough(WORKER_CONFIG), WORKER_CONFIG),
        ("Every connector", "Error handling (`errors.*`) included." +
         passthrough(CONNECTOR_CONFIG), CONNECTOR_CONFIG),
        ("Sink connectors", "Also for every sink connector.", SINK_CONFIG),
        ("Store sink (`StoreSinkConnector`)", "Kafka into a store: what `kcompact mirror` "
         "runs. Its consumer always reads `read_committed`; `auto.offset.reset=error` unless "
         "overridden (to accept a gap).", STORE_SINK_CONFIG),
        ("Store source (`StoreSourceConnector`)", "A store topic into Kafka: what "
         "`kcompact restore` runs.", STORE_SOURCE_CONFIG),
        ("LevelDB sink (`LevelDBSinkConnector`)", "A topic into a local key-value map: what "
         "`kcompact kv build --follow --bootstrap-servers` runs.", LEVELDB_SINK_CONFIG),
        ("`ByteArrayConverter`", "The bytes as they are; no settings.",
         ByteArrayConverter.CONFIG),
        ("`StringConverter`", "Settings take the `key.converter.`/`value.converter.` prefix.",
         StringConverter.CONFIG),
        ("`JsonConverter`", "Settings take the `key.converter.`/`value.converter.` prefix.",
         JsonConverter.CONFIG),
        ("`AvroConverter`", "Confluent's wire format with a Schema Registry; settings take the "
         "`key.converter.`/`value.converter.` prefix.", AvroConverter.CONFIG),
    ]


def connect_page() -> str:
    out = [_GENERATED, "# Connector and worker properties\n",
           "Every property of the Connect-style worker, the connectors and the converters, "
           "generated from their declarations (each key once: type, default, valid values, "
           "meaning). A key no table knows is refused by name, with a \"did you mean\". How "
           "to run them: [Connectors](../connectors.md).\n"]
    for title, intro, cdef in config_tables():
        out.append(f"\n## {title}\n\n{intro}\n")
        out.append(_table(cdef) if cdef.keys() else "No settings.\n")
    return "\n".join(out)


def topic_configs_page() -> str:
    from kcompact.reput.config import TOPIC_CONFIG
    return "\n".join([
        _GENERATED, "# Topic configs\n",
        "A store keeps each topic's configs under Kafka's names, in `store.json`: synced from "
        "the source topic by `kcompact mirror`, overridden with `kcompact configs --alter`, "
        "else the default below (precedence: default < synced < override; "
        "[Compaction](../compaction.md#topic-configs)). Generated from the table the code "
        "reads, `kcompact.reput.config.TOPIC_CONFIG`.\n",
        _table(TOPIC_CONFIG)])


def env_page() -> str:
    from kcompact.reput.env import DEV_ENV, ENV
    out = [_GENERATED, "# Environment variables\n",
           "Every `KCOMPACT_*` variable, generated from the tables of `kcompact.reput.env`. "
           "Unset or blank means the default; a value that does not parse stops the command "
           "with one line naming the variable.\n",
           "\n## Read by kcompact\n", _env_table(ENV),
           "\n## Read when kcompact is built\n\nNothing: `pip install` and `make install` compile "
           "the C extensions from what the sdist holds (librdkafka's header and zstd's decoder "
           "are vendored in `third_party/`).\n",
           "\n## Read by the tests and benchmarks\n", _env_table(DEV_ENV)]
    return "\n".join(out)


def _env_table(cdef: ConfigDef) -> str:
    rows = ["| variable | type | default | valid values | meaning |", "|---|---|---|---|---|"]
    for k in cdef.keys():
        default = "" if k.default in (None, "") else f"`{k.default_text()}`"
        rows.append(f"| `{k.name}` | {k.type.value} | {default} | {_cell(k.valid_values())} | "
                    f"{_cell(k.doc)} |")
    return "\n".join(rows) + "\n"


#: Generated pages: path under docs/ -> the function that writes it.
PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/topic-configs.md": topic_configs_page,
    "reference/connect.md": connect_page,
    "reference/environment.md": env_page,
}
