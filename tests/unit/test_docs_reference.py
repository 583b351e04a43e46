"""The guide's reference pages are generated from the code (connectors/devtools/reference.py);
these tests fail when a flag, a config key or a ``KCOMPACT_*`` variable lacks its doc, or when a
variable is read somewhere without being declared in kcompact.reput.env."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kcompact.connectors.cli import build_parser
from kcompact.connectors.devtools import reference
from kcompact.reput import env
from kcompact.reput.config import TOPIC_CONFIG, TopicConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reput", "compaction", "replication", "connectors", "kcompact")
#: Read directly by connectors/framework/native_kafka.py only to warn that it is gone (issue 39);
#: declared in ENV all the same.
READ_OUTSIDE_ENV = {"KCOMPACT_KAFKA_IO"}
NAME = re.compile(r"KCOMPACT_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*{])")  # not KCOMPACT_X_* or an f-string


def _sources(*roots: str, suffixes=(".py",)) -> list[Path]:
    out = []
    for r in roots:
        p = ROOT / r
        if p.is_file():
            out.append(p)
        else:
            out.extend(f for f in p.rglob("*") if f.suffix in suffixes and f.is_file())
    return out


def _all_tables():
    yield "topic configs", TOPIC_CONFIG
    for title, _intro, cdef in reference.config_tables():
        yield title, cdef
    yield "environment", env.ENV
    yield "build environment", env.BUILD_ENV
    yield "dev environment", env.DEV_ENV


def test_every_flag_of_every_command_has_help():
    missing = []
    for words, parser, help_text in reference.cli_commands(build_parser()):
        if words != "kcompact" and not help_text:
            missing.append(f"{words}: no one-line help")
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (a.help or "").strip():
                missing.append(f"{words} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, "flags without help text: " + ", ".join(missing)


def test_the_cli_page_lists_every_command_and_flag():
    page = reference.cli_page()
    for words, parser, _ in reference.cli_commands(build_parser()):
        assert f"`{words}`" in page, words
        for a in parser._actions:
            for opt in a.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}`" in page, f"{words} {opt}"


def test_every_config_key_has_a_doc_and_appears_on_its_page():
    pages = reference.topic_configs_page() + reference.connect_page() + reference.env_page()
    for title, cdef in _all_tables():
        for key in cdef.keys():
            assert key.doc.strip(), f"{title}: {key.name} has no doc"
            assert f"`{key.name}`" in pages, f"{title}: {key.name} is on no reference page"


def test_topic_config_defaults_are_the_tables():
    """TopicConfig's fields take their defaults from TOPIC_CONFIG (written once)."""
    cfg = TopicConfig()
    for key in TOPIC_CONFIG.keys():
        assert getattr(cfg, key.attr) == key.default, key.name


def test_every_kcompact_variable_is_declared_and_every_declared_one_is_used():
    declared = {k.name for _, t in _all_tables() if t in (env.ENV, env.BUILD_ENV, env.DEV_ENV)
                for k in t.keys()}
    files = _sources(*PACKAGES, "tests", "bench", "setup.py") + [ROOT / "Makefile"]
    used: dict[str, set[str]] = {}
    for f in files:
        if f == ROOT / "reput" / "env.py":
            continue
        for name in NAME.findall(f.read_text(encoding="utf-8", errors="replace")):
            used.setdefault(name, set()).add(str(f.relative_to(ROOT)))
    undeclared = {n: sorted(fs) for n, fs in used.items() if n not in declared}
    assert not undeclared, f"KCOMPACT_* variables missing from kcompact.reput.env: {undeclared}"
    unused = sorted(declared - set(used))
    assert not unused, f"declared in kcompact.reput.env but read nowhere: {unused}"


def test_package_code_reads_kcompact_variables_through_env():
    direct = re.compile(r"(?:environ\.get|getenv)\(\s*[\"'](KCOMPACT_[A-Z0-9_]+)|"
                        r"environ\[\s*[\"'](KCOMPACT_[A-Z0-9_]+)[\"']\s*\](?!\s*=)")
    found = []
    for f in _sources(*PACKAGES):
        if f == ROOT / "reput" / "env.py":
            continue
        for m in direct.finditer(f.read_text(encoding="utf-8")):
            name = m.group(1) or m.group(2)
            if name not in READ_OUTSIDE_ENV:
                found.append(f"{f.relative_to(ROOT)}: {name}")
    assert not found, ("read the variable with kcompact.reput.env.value/flag (its default and "
                       "doc live there): " + ", ".join(found))


@pytest.mark.parametrize("raw, expect", [("", 256), ("64", 64)])
def test_env_value_parses_and_defaults(raw, expect):
    assert env.value("KCOMPACT_S3_CACHE_MB", {"KCOMPACT_S3_CACHE_MB": raw}) == expect


def test_env_value_names_the_variable_on_a_bad_value():
    with pytest.raises(env.ConfigError, match=r"KCOMPACT_REPLICATION_PARALLEL='0': 0 is out "):
        env.value("KCOMPACT_REPLICATION_PARALLEL", {"KCOMPACT_REPLICATION_PARALLEL": "0"})
    with pytest.raises(env.ConfigError, match=r"KCOMPACT_S3_GRACE_MS='soon': expected an integ"):
        env.value("KCOMPACT_S3_GRACE_MS", {"KCOMPACT_S3_GRACE_MS": "soon"})


def test_every_generated_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for path in reference.PAGES:
        assert f": {path}" in nav, f"{path} is generated but not in mkdocs.yml's nav"
