"""Unit tests (no processes). A package, so that module names such as test_restore may also
be used by tests/integration/ (pytest's default import mode needs unique basenames otherwise)."""
