"""LLVM intrinsics for the numba kernels: unaligned little-endian loads/stores and SSE4.2 CRC32C.

Records are byte-packed, so integers inside them are unaligned; these compile to single mov
instructions instead of byte-by-byte assembly. ``HAVE_SSE42`` says whether the CPU has the
CRC32 instruction; reput/_kernels.py falls back to a slicing-by-8 table otherwise.

Declared with reput/jit.py's lazy ``intrinsic``: numba is imported (inside the typing
functions below) only when a kernel that uses them is first compiled or loaded. Public: the
numba kernels of every layer (compaction's offset map, the KV map) build on them.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir  # the IR builder only (pure Python); LLVM itself loads with numba

from .jit import intrinsic

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("kcompact's kernels assume a little-endian CPU")


def _cpu_has_sse42() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any("sse4_2" in line for line in f if line.startswith("flags"))
    except OSError:
        return False


HAVE_SSE42 = _cpu_has_sse42()


def _load(bits: int):
    @intrinsic
    def load(typingctx, arr, idx):
        from numba import types
        ret = {8: types.uint8, 16: types.uint16, 32: types.uint32, 64: types.uint64}[bits]
        sig = ret(arr, idx)

        def codegen(context, builder, signature, args):
            a = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(a.data, [args[1]])
            return builder.load(builder.bitcast(ptr, ir.IntType(bits).as_pointer()), align=1)
        return sig, codegen
    return load


def _store(bits: int):
    @intrinsic
    def store(typingctx, arr, idx, val):
        from numba import types
        sig = types.void(arr, idx, val)

        def codegen(context, builder, signature, args):
            a = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(a.data, [args[1]])
            v = context.cast(builder, args[2], signature.args[2],
                             getattr(types, f"uint{bits}"))
            builder.store(v, builder.bitcast(ptr, ir.IntType(bits).as_pointer()), align=1)
            return context.get_dummy_value()
        return sig, codegen
    return store


load_u32 = _load(32)
load_u64 = _load(64)
store_u32 = _store(32)
store_u64 = _store(64)


@intrinsic
def crc32_u64(typingctx, crc, data):
    from numba import types
    from numba.core import cgutils
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.64.64")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def crc32_u8(typingctx, crc, data):
    from numba import types
    from numba.core import cgutils
    sig = types.uint32(types.uint32, types.uint8)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(8)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse42.crc32.32.8")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the CPU to load arr[idx]'s cache line (read, high locality)."""
    from numba import types
    from numba.core import cgutils
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen
