"""Compiling the library's Triton kernels for an H100 (sm_90) on a machine without a GPU: Triton's interpreter
(``TRITON_INTERPRET=1``, which the CPU tests run under) accepts code that the GPU compiler refuses, and shows
nothing of registers or spills, so each kernel module's tests compile its kernels here too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


#: What :func:`compile_for_sm90` runs before a script: ``registers_and_stack(fn, signature, constexprs, num_warps)``,
#: a kernel's registers and spilled stack bytes when compiled for sm_90 (from ``cuobjdump --dump-resource-usage``).
PREAMBLE = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def registers_and_stack(fn, signature, constexprs, num_warps):
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
"""


def compile_for_sm90(script: str) -> list[str]:
    """Run ``script`` (code that compiles kernels for sm_90, with :data:`PREAMBLE`'s ``registers_and_stack`` or
    ``triton.compile`` itself, and prints one line per kernel) in a process without ``TRITON_INTERPRET``, and return
    its printed lines. Skips the test
    where this Triton bundles no CUDA toolchain (``cuobjdump``)."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no bundled CUDA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns when unset)
    out = subprocess.run([sys.executable, "-c", PREAMBLE + script], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()
