"""numba kernels, loaded when first needed: ``njit`` and ``intrinsic`` as numba's, but lazy.

The product's kernels are C (each layer's ``_native`` extension, always built: setup.py); numba
runs only the few kernels that have no C twin (reput/_kernels.py: the writer's encode, the key
digest, topic runs, .bcq entries of a scan; the store source's murmur2 partitioner) and, in the
tests, the numba twins of the C kernels that the tests compare them with (issue 39: one kernel
per job; the switch that ran everything on numba is gone).

Importing numba loads LLVM (``libllvmlite.so``): about 120 MiB of resident pages and 0.4 s
before any kernel runs. Most kcompact processes need kernels soon anyway, but some need few or
none (``kcompact compact`` with the C kernels of ``kcompact.compaction._native``, ``kv get``,
``inspect``), and
a compaction's memory budget (``--offset-map-memory``) should not pay for a compiler it never
calls. So the kernels are declared with this module's decorators, which only record them; the
first call of any kernel imports numba, turns every recorded function into a numba dispatcher or
intrinsic (compiled code comes from numba's on-disk cache, as before), and rebinds the module
globals that named the placeholders, so that kernels calling kernels are typed against the real
dispatchers. After that a placeholder only forwards to its dispatcher.

``loaded()`` tells whether numba has been loaded in this process (tests use it).

``native()`` is kcompact.reput._native.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

_lock = threading.RLock()
_pending: list["_Lazy"] = []
_loaded = False


class _Lazy:
    """A kernel or intrinsic not compiled yet; calling it loads them all."""


    def __init__(self, py_func: Callable, options: dict, kind: str):
        self.py_func, self.options, self.kind, self.real = py_func, options, kind, None
        self.__name__ = py_func.__name__
        self.__qualname__ = py_func.__qualname__
        self.__doc__ = py_func.__doc__
        self.__module__ = py_func.__module__
        self.__wrapped__ = py_func

    def __call__(self, *args, **kwargs):
        real = self.real
        if real is None:
            load()
            real = self.real
        return real(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # .signatures, .py_func of the dispatcher, ...
        if name.startswith("__"):
            raise AttributeError(name)
        load()
        return getattr(self.real, name)

    def __repr__(self) -> str:
        state = "loaded" if self.real is not None else "not loaded"
        return f"<kcompact {self.kind} {self.__qualname__} ({state})>"


def njit(*args, **options):
    """``@njit(cache=True, nogil=True, ...)`` recorded now, compiled on first use."""
    def deco(fn: Callable) -> _Lazy:
        return _register(_Lazy(fn, options, "kernel"))
    if args and callable(args[0]) and len(args) == 1 and not options:
        return deco(args[0])
    return deco


def intrinsic(fn: Callable) -> _Lazy:
    """``@intrinsic`` (numba.extending) recorded now, defined on first use."""
    return _register(_Lazy(fn, {}, "intrinsic"))


def _register(lazy: _Lazy) -> _Lazy:
    with _lock:
        if _loaded:
            _realize(lazy)
            _rebind({id(lazy): lazy.real})
        else:
            _pending.append(lazy)
    return lazy


def _realize(lazy: _Lazy) -> None:
    if lazy.kind == "intrinsic":
        from numba.extending import intrinsic as numba_intrinsic
        lazy.real = numba_intrinsic(lazy.py_func)
    else:
        from numba import njit as numba_njit
        lazy.real = numba_njit(**lazy.options)(lazy.py_func)


def _rebind(swap: dict[int, Any]) -> None:
    """Replace placeholders by their dispatchers in every loaded module's globals (what numba
    reads when it types a kernel that calls another)."""
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for k, v in list(d.items()):
            if type(v) is _Lazy and id(v) in swap:
                d[k] = swap[id(v)]


def load() -> None:
    """Import numba and compile (or load from its cache, lazily per signature) every kernel."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        pending = list(_pending)
        # intrinsics first: kernels refer to them
        for lazy in sorted(pending, key=lambda z: z.kind != "intrinsic"):
            _realize(lazy)
        _rebind({id(z): z.real for z in pending})
        _pending.clear()
        _loaded = True


def native():
    """kcompact.reput._native: the record, index and format-2 kernels in C (always built:
    setup.py). Kept for the modules that ask for it by this name."""
    from . import _native
    return _native


def loaded() -> bool:
    """Whether numba has been loaded in this process (by a kernel call or ``load()``)."""
    return _loaded


__all__ = ["intrinsic", "load", "loaded", "native", "njit"]
