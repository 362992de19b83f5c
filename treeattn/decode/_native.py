"""The "cpu" backend: a C++ kernel for XLA:CPU, built from `_cpu_kernel.cc` on first use.

The kernel is compiled with the host's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`)
against the XLA FFI headers of the running jaxlib, for the host CPU (`-march=native`), and kept
in a cache directory (`$TREEATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/treeattn`, else
`~/.cache/treeattn`) under a name that hashes the source, the jax version, the compiler, the
flags and the CPU, so a shared home directory over different machines is safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax import lax


TARGET = "treeattn_cpu_decode"
SOURCE = Path(__file__).with_name("_cpu_kernel.cc")
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp-simd",  # the `omp simd` reductions vectorise without OpenMP's runtime
    "-fno-math-errno",
)


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (set $CXX, or install g++ or clang++)")


def cache_dir() -> Path:
    if os.environ.get("TREEATTN_CACHE_DIR"):
        return Path(os.environ["TREEATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "treeattn"


def _build() -> Path:
    cxx = _compiler()
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    # The FFI headers come from jaxlib.
    versions = f"{jax.__version__} {jaxlib.__version__}"
    for part in (SOURCE.read_bytes(), versions, cxx, " ".join(FLAGS), _cpu_id()):
        key.update(part if isinstance(part, bytes) else part.encode())
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"cpu_kernel_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    # Build under a temporary name and rename: processes that race here (one per host of a
    # multi-process run) each produce a complete file, and the rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def load_kernel() -> str | None:
    """Builds (or finds) the kernel and registers it with XLA on first call; afterwards, why it
    cannot be used in this process, or None. A failed build is not retried."""
    try:
        library = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.TreeattnCpuDecode), platform="cpu"
        )
    except Exception as e:  # no compiler, a failed build, an unwritable cache
        return f"the C++ kernel could not be built ({e})"
    return None


def _ffi(q, k, v, q_offset, kv_length, kv_pos, *, scale, causal, bhsd, has_pos):
    batch, q_seq, heads, _ = q.shape
    out_types = (
        jax.ShapeDtypeStruct((batch, q_seq, heads, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((batch, heads, q_seq), jnp.float32),
    )
    return jax.ffi.ffi_call(TARGET, out_types)(
        q,
        k,
        v,
        q_offset,
        kv_length,
        kv_pos,
        scale=np.float32(scale),
        causal=causal,
        bhsd=bhsd,
        has_pos=has_pos,
    )


@functools.cache
def _kernel(scale: float, causal: bool, bhsd: bool, has_pos: bool):
    """The kernel call for one set of static attributes, with a vmap rule: a vmapped axis over
    batched K/V (a batch of caches) joins the kernel's batch axis, so `jax.vmap` costs one call,
    not a loop; with K/V shared across the axis, the calls run one after another (folding them
    in would copy the cache)."""
    attrs = dict(scale=scale, causal=causal, bhsd=bhsd, has_pos=has_pos)

    @jax.custom_batching.custom_vmap
    def kernel(q, k, v, q_offset, kv_length, kv_pos):
        return _ffi(q, k, v, q_offset, kv_length, kv_pos, **attrs)

    @kernel.def_vmap
    def _rule(axis_size, in_batched, *args):
        pairs = list(zip(args, in_batched, strict=True))
        if not (in_batched[1] and in_batched[2]):

            def one(batched):
                it = iter(batched)
                return kernel(*(next(it) if b else a for a, b in pairs))

            return lax.map(one, [a for a, b in pairs if b]), (True, True)
        batch = args[1].shape[1]

        def fold(a, b):
            a = a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            return a.reshape(axis_size * batch, *a.shape[2:])

        out, lse = kernel(*(fold(a, b) for a, b in pairs))
        unfold = (x.reshape(axis_size, batch, *x.shape[1:]) for x in (out, lse))
        return tuple(unfold), (True, True)

    return kernel


def cpu_forward(q, k, v, q_offset, kv_length, kv_pos, *, dims, causal, scale, block):
    """`(out, lse)` from the C++ kernel (built by `load_kernel()`, which eligibility calls
    first): online softmax over blocks of 512 keys, each K and V row read once; batch rows
    x kv heads run on XLA's intra-op thread pool. Offsets, lengths and positions arrive int32."""
    del block
    has_pos = kv_pos is not None
    if kv_pos is None:
        kv_pos = jnp.zeros((dims.batch, 0), jnp.int32)
    kernel = _kernel(float(scale), bool(causal), dims.layout == "bhsd", has_pos)
    out, lse = kernel(q, k, v, q_offset, kv_length, kv_pos)
    return out, jnp.swapaxes(lse, 1, 2)  # the kernel writes [batch, heads, q_seq]
