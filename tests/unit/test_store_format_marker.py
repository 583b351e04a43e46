"""store.json's format version is the marker a kcompact that does not know a store's objects trips
on (docs/formats/store-json.md; docs/formats/shared-upload.md relies on it for issue 43's store
format 3): a store.json with a newer ``format_version`` and a valid checksum is refused with one
line naming both versions and saying to upgrade, on a local store and on S3, from the Python API
and from the CLI, and nothing is written to the store."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _stores import backend, store_at  # noqa: E402,F401

from kcompact.connectors.cli import main  # noqa: E402
from kcompact.reput import KNOWN_FORMAT_VERSION, Store, StoreFormatError, StoreMeta, backend_for  # noqa: E402
from kcompact.reput.record import RecordBatch  # noqa: E402


def _newer_store(url: str) -> bytes:
    """A store with one record, then its store.json rewritten (checksum valid) one format newer,
    with the feature a newer writer would list; returns store.json's bytes."""
    with Store.open(url, writer="w", create=True) as s:
        s.append(RecordBatch.from_records("t", [(0, 0, 1_000, b"k", b"v", [])]))
        s.flush()
    fs = backend_for(url)
    meta = StoreMeta.from_json(fs.read("store.json"), url)
    meta.format_version = KNOWN_FORMAT_VERSION + 1
    meta.features = [*meta.features, "shared-upload"]
    raw = meta.to_json()
    fs.write_atomic("store.json", raw)
    return raw


def test_a_newer_format_is_refused_by_the_api_with_one_line(store_at):
    url = store_at("newer")
    raw = _newer_store(url)
    with pytest.raises(StoreFormatError) as e:
        Store.open(url)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"version {KNOWN_FORMAT_VERSION + 1}" in msg and f"({KNOWN_FORMAT_VERSION})" in msg
    assert "upgrade kcompact" in msg
    with pytest.raises(StoreFormatError):
        Store.open(url, writer="w2")
    assert backend_for(url).read("store.json") == raw  # refused before anything is written


def test_a_newer_format_is_refused_by_the_cli_with_one_line(store_at):
    url = store_at("newer-cli")
    raw = _newer_store(url)
    for argv in (["inspect", "--store", url], ["dump", "--store", url, "--topic", "t", "--partition", "0"]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        assert code != 0, argv
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        assert len(lines) == 1 and "upgrade kcompact" in lines[0], (argv, err.getvalue())
        assert out.getvalue() == ""
    assert backend_for(url).read("store.json") == raw
