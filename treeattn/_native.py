"""treeattn's C++ kernels for XLA:CPU, built from `_cpu_kernel.cc` on first use: the decode
attention of `treeattn.decode`'s `"cpu"` backend, the matrix products of
`treeattn.models.matmul` (few rows on `[out, in]` weights, any number on packed ones), SwiGLU's
gate, a pre-norm block's MLP and a pre-norm attention's inputs on packed weights (one call each),
and the in-place slice write of a KV cache (16-bit, or a batch's rows).

The kernel is compiled with the host's C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`)
against the XLA FFI headers of the running jaxlib, for the host CPU (`-march=native`), and kept
in a cache directory (`$TREEATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/treeattn`, else
`~/.cache/treeattn`) under a name that hashes the source, the jax version, the compiler, the
flags and the CPU, so a shared home directory over different machines is safe.

Next to each library `cpu_kernel_<hash>.so` lies its manifest `cpu_kernel_<hash>.json`: size,
SHA-256, the compiler command and its version. A library is loaded only if it matches its
manifest: a damaged cache file would otherwise crash the process inside the dynamic loader
(a truncated library raises SIGBUS there), and Python cannot catch that.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib


TARGET = "treeattn_cpu_decode"
SYMBOL = "TreeattnCpuDecode"
MATMUL_TARGET = "treeattn_cpu_matmul"
MATMUL_SYMBOL = "TreeattnCpuMatmul"
PACKED_TARGET = "treeattn_cpu_matmul_packed"
PACKED_SYMBOL = "TreeattnCpuMatmulPacked"
GATED_TARGET = "treeattn_cpu_matmul_gated"
GATED_SYMBOL = "TreeattnCpuMatmulGated"
MLP_TARGET = "treeattn_cpu_mlp"
MLP_SYMBOL = "TreeattnCpuMlp"
QKV_TARGET = "treeattn_cpu_qkv"
QKV_SYMBOL = "TreeattnCpuQkv"
# Output rows per panel of a packed weight (`kPanel` in the kernel).
PANEL = 16
WRITE_TARGET = "treeattn_cpu_write"
WRITE_SYMBOL = "TreeattnCpuWrite"
SOURCE = Path(__file__).with_name("_cpu_kernel.cc")
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp-simd",  # the `omp simd` reductions vectorise without OpenMP's runtime
    "-fno-math-errno",
    "-ffp-contract=fast",  # fused multiply-adds in the register tiles (ISO -std= turns them off)
)
# The build took about 4 s on an idle 2-core machine, up to 11 s with both cores busy; 60 s leaves
# room for slower machines while bounding what a hung compiler costs the first CPU decode.
DEFAULT_BUILD_TIMEOUT = 60.0

_log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """Why the kernel cannot be built or loaded here."""


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _compiler() -> list[str]:
    """The compiler command: `$CXX` (split like a shell word list) if set, else the first of
    `c++`, `g++`, `clang++` on PATH. A `$CXX` that is not found is an error, not a cue to use
    another compiler."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        cmd = shlex.split(cxx)
        if shutil.which(cmd[0]) is None:
            raise BuildError(f"$CXX={cxx!r} is not found (unset CXX to use c++, g++ or clang++)")
        return cmd
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name]
    raise BuildError("no C++ compiler found (set $CXX, or install g++ or clang++)")


def build_timeout() -> float:
    """Seconds a build may take, all steps together: `$TREEATTN_BUILD_TIMEOUT`, default 60."""
    text = os.environ.get("TREEATTN_BUILD_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_BUILD_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise BuildError(f"TREEATTN_BUILD_TIMEOUT={text!r} is not a positive number of seconds")
    return seconds


def cache_dir() -> Path:
    if os.environ.get("TREEATTN_CACHE_DIR"):
        return Path(os.environ["TREEATTN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "treeattn"


def _run(cmd: list[str], deadline: float, timeout: float) -> tuple[int, str]:
    """Runs `cmd` in its own process group until `deadline` (time.monotonic()); returns its exit
    code and output. Past the deadline the whole group is killed (a compiler driver's children
    with it). Output goes to a file, not a pipe, so a stray child cannot block the read."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise BuildError(f"the build exceeded {timeout:g} s (TREEATTN_BUILD_TIMEOUT)")
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"{shlex.join(cmd)} did not finish within {timeout:g} s "
                "(TREEATTN_BUILD_TIMEOUT); it was killed"
            ) from None
        finally:
            if proc.returncode is None:  # timed out, or interrupted
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        output.seek(0)
        return code, output.read().decode(errors="replace")


def _elf_problem(data: bytes) -> str | None:
    """What makes `data` not a complete shared library for this process (ELF only), or None.

    Checks the header (magic, word size, byte order, type ET_DYN) and that every loadable
    segment and the section header table lie within the file: the loader maps segments beyond
    the end of a truncated file, and touching them raises SIGBUS."""
    if sys.platform == "darwin" or sys.platform.startswith("win"):
        return None  # Mach-O / PE: the manifest's SHA-256 still guards the file
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return f"no ELF shared library ({len(data)} bytes, starting {data[:4]!r})"
    is64 = data[4] == 2
    if is64 != (sys.maxsize > 2**32) or data[5] != (1 if sys.byteorder == "little" else 2):
        return "an ELF file for another word size or byte order"
    end = "<" if data[5] == 1 else ">"
    header = struct.unpack_from(end + ("HHIQQQIHHHHHH" if is64 else "HHIIIIIHHHHHH"), data, 16)
    e_type, phoff, shoff = header[0], header[4], header[5]
    phentsize, phnum, shentsize, shnum = header[8], header[9], header[10], header[11]
    if e_type != 3:
        return f"an ELF file of type {e_type}, not a shared library (3)"
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
        return f"a truncated ELF file ({len(data)} bytes; its header tables end beyond)"
    for i in range(phnum):
        at = phoff + i * phentsize
        if is64:
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(end + "IIQQQQ", data, at)
        else:
            p_type, p_offset, _, _, p_filesz = struct.unpack_from(end + "IIIII", data, at)
        if p_type == 1 and p_offset + p_filesz > len(data):  # PT_LOAD
            return f"a truncated ELF file ({len(data)} bytes; segment {i} ends beyond)"
    return None


def _verify(lib: Path, manifest: Path) -> str | None:
    """Why the cached `lib` must not be loaded, or None if it matches its manifest."""
    try:
        record = json.loads(manifest.read_text())
        size, sha256 = record["size"], record["sha256"]
    except FileNotFoundError:
        return f"{manifest.name} is missing"
    except (OSError, ValueError, TypeError, KeyError) as e:
        return f"{manifest.name} is unreadable ({e!r})"
    try:
        data = lib.read_bytes()
    except OSError as e:
        return f"{lib.name} is unreadable ({e.strerror})"
    if len(data) != size:
        return f"{lib.name} has {len(data)} bytes, its manifest says {size}"
    if hashlib.sha256(data).hexdigest() != sha256:
        return f"{lib.name} does not match the SHA-256 in its manifest"
    return None


@contextlib.contextmanager
def _lock(path: Path, deadline: float, timeout: float):
    """An exclusive lock on `path` for one build at a time per cache entry (processes of a
    multi-process run start together); where file locks are unavailable, no lock."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a") as f:
        locked = False
        while not locked:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(
                        f"another process held {path} for over {timeout:g} s "
                        "(TREEATTN_BUILD_TIMEOUT)"
                    ) from None
                time.sleep(0.05)
            except OSError:  # e.g. a network file system without locking
                break
        try:
            yield
        finally:
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _publish(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Loads the new library in a separate interpreter first: should it still crash the loader,
# that process dies, not the user's.
_TRIAL_LOAD = f"import ctypes, sys; ctypes.CDLL(sys.argv[1]).{SYMBOL}"


def _compile(cxx: list[str], lib: Path, manifest: Path, deadline: float, timeout: float) -> None:
    """Compiles the kernel into `lib` and writes `manifest`, each published with os.replace
    (the library first), so readers see either nothing, or a complete library whose manifest
    may still be missing (they then wait for the lock), or both."""
    include = jax.ffi.include_dir()
    code, output = _run([*cxx, "--version"], deadline, timeout)
    version = output.strip().splitlines()[0] if code == 0 and output.strip() else "unknown"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent, prefix=f".{lib.stem}.")
    os.close(fd)
    cmd = [*cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        code, output = _run(cmd, deadline, timeout)
        if code != 0:
            raise BuildError(f"{shlex.join(cmd)} failed (exit {code}):\n{output[-4000:]}")
        data = Path(tmp).read_bytes()
        if problem := _elf_problem(data):
            raise BuildError(f"{shlex.join(cmd)} wrote {problem}")
        code, output = _run([sys.executable, "-c", _TRIAL_LOAD, tmp], deadline, timeout)
        if code != 0:
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            raise BuildError(f"the library from {shlex.join(cmd)} does not load ({how}): {output}")
        record = {
            "library": lib.name,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "compiler": cxx,
            "compiler_version": version,
            "flags": [*FLAGS, f"-I{include}"],
            "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        }
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _publish(manifest, json.dumps(record, indent=1).encode())


def _build() -> Path:
    """The path of a verified kernel library for this source, jax, compiler, flags and CPU:
    the cached one if it matches its manifest, else built afresh (a damaged or unverifiable
    cached file is deleted first). Raises `BuildError` saying why not."""
    cxx = _compiler()
    timeout = build_timeout()
    deadline = time.monotonic() + timeout
    key = hashlib.sha256()
    # The FFI headers come from jaxlib.
    versions = f"{jax.__version__} {jaxlib.__version__}"
    for part in (SOURCE.read_bytes(), versions, shlex.join(cxx), " ".join(FLAGS), _cpu_id()):
        key.update(part if isinstance(part, bytes) else part.encode())
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lib = directory / f"cpu_kernel_{key.hexdigest()[:16]}.so"
    manifest = lib.with_suffix(".json")
    if _verify(lib, manifest) is None:
        return lib
    with _lock(lib.with_suffix(".lock"), deadline, timeout):
        problem = _verify(lib, manifest)  # again: another process may have built it meanwhile
        if problem is None:
            return lib
        if lib.exists() or manifest.exists():
            _log.warning("treeattn: discarding the cached C++ kernel (%s); rebuilding", problem)
            lib.unlink(missing_ok=True)
            manifest.unlink(missing_ok=True)
        _compile(cxx, lib, manifest, deadline, timeout)
    return lib


_loaded: dict[str, Any] = {}


@functools.cache
def load_kernel() -> str | None:
    """Finds, verifies or builds the kernel, loads it and registers it with XLA; returns the
    reason the kernel cannot be used in this process, or None once it is registered. Runs once
    per process: a failed or timed-out build is not retried."""
    try:
        lib = _build()
        record = json.loads(lib.with_suffix(".json").read_text())
        library = ctypes.cdll.LoadLibrary(str(lib))
        for target, symbol in (
            (TARGET, SYMBOL),
            (MATMUL_TARGET, MATMUL_SYMBOL),
            (PACKED_TARGET, PACKED_SYMBOL),
            (GATED_TARGET, GATED_SYMBOL),
            (MLP_TARGET, MLP_SYMBOL),
            (QKV_TARGET, QKV_SYMBOL),
            (WRITE_TARGET, WRITE_SYMBOL),
        ):
            capsule = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
        _loaded.update(record, library=str(lib))
    except Exception as e:  # no compiler, a failed build, a timeout, an unwritable cache
        return f"the C++ kernel cannot be used ({e})"
    return None


def kernel_info() -> dict[str, Any] | None:
    """The manifest of the kernel this process uses (loading it first, as the backend selector
    would): `library` (path), `size`, `sha256`, `compiler` (the command), `compiler_version`
    (first line of `--version`), `flags`, `jax`, `jaxlib`; None if it is unavailable, for the
    reason `load_kernel()` returns."""
    return None if load_kernel() is not None else dict(_loaded)
