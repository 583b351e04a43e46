"""Only the C extension lives here; everything else is in pyproject.toml.

reput._native holds the compaction kernels in C (reput/_native.c), so that a compaction runs
without loading numba and LLVM. It is optional: without a C compiler the install goes on and the
numba kernels are used instead (reput/_jit.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("reput._native", ["reput/_native.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)])
