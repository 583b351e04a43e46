"""Unit tests (no processes). A package, so that module names such as test_restore may also
be used by tests/integration/ (pytest's default import mode needs unique basenames otherwise)."""

import os as _os
import sys as _sys

# the numba twins of the C kernels (_oracle_*.py, the tests' reference) import as top-level
# modules, as _stores does
if _os.path.dirname(__file__) not in _sys.path:
    _sys.path.insert(0, _os.path.dirname(__file__))
