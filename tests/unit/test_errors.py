"""One error root (issue 39): every package's root is a ``KcompactError``, there is one
``ConfigError``, and the command line prints any ``KcompactError`` as one line with exit 1."""

from __future__ import annotations

import kcompact
from kcompact import compaction, connectors, replication, reput
from kcompact.connectors.cli import main
from kcompact.errors import ConfigError, KcompactError


def test_each_package_root_is_a_kcompact_error():
    for root in (reput.ReputError, compaction.CompactionError, replication.ReplicationError,
                 connectors.ConnectorsError):
        assert issubclass(root, KcompactError), root
    assert not issubclass(KcompactError, (reput.ReputError, connectors.ConnectorsError))


def test_one_config_error_for_every_layer():
    assert reput.ConfigError is connectors.ConfigError is ConfigError
    assert kcompact.ConfigError is ConfigError and kcompact.KcompactError is KcompactError
    assert issubclass(ConfigError, ValueError)
    e = ConfigError("store.partitions: must be 0-3", key="store.partitions")
    assert str(e.for_flags({"store.partitions": "--partitions"})) == "--partitions: must be 0-3"


def test_a_storage_config_error_is_one_line_exit_1(tmp_path, capsys):
    """A topic config the store refuses (raised by kcompact.reput, caught as a KcompactError)."""
    store = str(tmp_path / "s")
    reput.Store.create(store)
    code = main(["configs", "--store", store, "--topic", "t", "--alter",
                 "--add-config", "no.such.key=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == [err[0]] and err[0].startswith("kcompact: error: ") and "no.such.key" in err[0]
