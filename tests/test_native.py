"""The cpu backend's build: a verified cache, bounded build time, the compiler it names.

Loading is once per process, so what a user's next process does runs in a fresh interpreter
(`decode_in_child`), each with its own cache directory.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import check_out_lse

from treeattn import _native
from treeattn.decode._native import _ffi


ROOT = Path(__file__).resolve().parents[1]

# A decode with GQA and a partly filled row, for each backend named on the command line; prints
# JSON: per backend (out, lse, and whether the C++ kernel ran) or the BackendUnavailable message.
DECODE = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from treeattn import _native
    from treeattn.decode import BackendUnavailable, flash_attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 8), np.float32)
    k, v = rng.standard_normal((2, 2, 50, 2, 8), np.float32)
    result = {}
    for backend in sys.argv[1:]:
        def f(q, k, v):
            return flash_attention(q, k, v, kv_length=jnp.asarray([50, 17]), backend=backend)
        try:
            out, lse = f(q, k, v)
        except BackendUnavailable as e:
            result[backend] = {"error": str(e)}
            continue
        result[backend] = {
            "out": np.asarray(out).tolist(),
            "lse": np.asarray(lse).tolist(),
            "fused": "ffi_call" in str(jax.make_jaxpr(f)(q, k, v)),
        }
    result["info"] = _native.kernel_info()
    print(json.dumps(result))
    """
)


def decode_in_child(cache: Path, *backends: str, limit: float, **env: str):
    """Runs DECODE in a new interpreter; returns (its JSON result, seconds taken). Fails if it
    dies (a signal gives a negative exit code) or outlives `limit` seconds."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CXX", "TREEATTN_BUILD_TIMEOUT")}
    environ.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")]),
        JAX_PLATFORMS="cpu",
        TREEATTN_CACHE_DIR=str(cache),
        **env,
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", DECODE, *backends],
        env=environ,
        capture_output=True,
        text=True,
        timeout=limit,
    )
    took = time.monotonic() - start
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1]), took


def check_decode(result):
    """`result` (one backend's entry) against float64 NumPy on DECODE's inputs."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 8), np.float32)
    k, v = rng.standard_normal((2, 2, 50, 2, 8), np.float32)
    expected = ref.decode(q, k, v, np.asarray([50, 17]))
    got = np.asarray(result["out"], np.float32), np.asarray(result["lse"], np.float32)
    check_out_lse(*got, *expected, jnp.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One kernel built with the default compiler into a private cache: (library, manifest)."""
    cache = tmp_path_factory.mktemp("pristine")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREEATTN_CACHE_DIR", str(cache))
        mp.delenv("TREEATTN_BUILD_TIMEOUT", raising=False)
        lib = _native._build()
    return lib, lib.with_suffix(".json")


def copy_cache(built, directory: Path) -> tuple[Path, Path]:
    directory.mkdir()
    lib, manifest = (Path(shutil.copy2(path, directory)) for path in built)
    return lib, manifest


def damage(how: str, lib: Path, manifest: Path) -> None:
    data = lib.read_bytes()
    if how == "truncated":  # segments end beyond the file: mapping them raised SIGBUS
        lib.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        lib.write_bytes(np.random.default_rng(1).bytes(len(data)))
    elif how == "bitflip":  # same size, valid ELF header
        middle = len(data) // 2
        lib.write_bytes(
            data[:middle]
            + bytes(b ^ 0xFF for b in data[middle : middle + 64])
            + data[middle + 64 :]
        )
    elif how == "no_manifest":
        manifest.unlink()
    else:
        raise AssertionError(how)


def test_manifest_describes_the_build(built):
    """The manifest records the library's size and SHA-256, and the compiler that ran with the
    first line of its `--version`."""
    lib, manifest = built
    record = json.loads(manifest.read_text())
    data = lib.read_bytes()
    assert record["size"] == len(data)
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    version = subprocess.run([*record["compiler"], "--version"], capture_output=True, text=True)
    assert record["compiler_version"] == version.stdout.splitlines()[0]
    assert record["compiler"] == _native._compiler()
    assert record["flags"][: len(_native.FLAGS)] == list(_native.FLAGS)
    assert record["jax"] == jax.__version__
    assert _native._verify(lib, manifest) is None
    assert _native._elf_problem(data) is None


@pytest.mark.parametrize("how", ["truncated", "garbage", "bitflip", "no_manifest"])
def test_damage_is_detected(built, tmp_path, how):
    """Each kind of damage is found before the library reaches the dynamic loader."""
    lib, manifest = copy_cache(built, tmp_path / "cache")
    damage(how, lib, manifest)
    assert _native._verify(lib, manifest) is not None
    if how in ("truncated", "garbage"):  # found without the manifest too
        assert _native._elf_problem(lib.read_bytes()) is not None


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbage", "no_manifest"])
def test_damaged_cache_is_rebuilt(built, tmp_path, how):
    """A process that finds a damaged cached library rebuilds it and decodes correctly, with
    "auto" on the C++ kernel and with "cpu" explicitly, instead of dying in the loader."""
    lib, manifest = copy_cache(built, tmp_path / "cache")
    damage(how, lib, manifest)
    result, took = decode_in_child(lib.parent, "auto", "cpu", limit=240)
    for backend in ("auto", "cpu"):
        check_decode(result[backend])
        assert result[backend]["fused"], backend
    record = json.loads(manifest.read_text())
    assert _native._verify(lib, manifest) is None
    assert result["info"]["sha256"] == record["sha256"]
    assert result["info"]["library"] == str(lib)
    assert result["info"]["compiler"] == json.loads(built[1].read_text())["compiler"]
    print(f"rebuild after {how}: {took:.1f} s")


FAKE_COMPILER = """#!/bin/sh
# Answers --version, then on a compile starts a child that outlives any timeout and waits.
echo "$*" >> {log}
if [ "$1" = --version ]; then echo "fake-c++ 1.0"; exit 0; fi
sleep 600 &
echo $! > {pid}
wait
"""


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.parametrize("compiler", ["hangs", "missing"])
def test_without_a_usable_compiler(tmp_path, compiler):
    """A compiler that never returns is stopped after $TREEATTN_BUILD_TIMEOUT (its process group
    killed, no retry in the process), and a $CXX that does not exist is not replaced by
    another compiler: either way "auto" decodes on the xla kernel, and "cpu" raises saying why."""
    log, pid = tmp_path / "compiler.log", tmp_path / "child.pid"
    script = tmp_path / "hung-c++"
    script.write_text(FAKE_COMPILER.format(log=log, pid=pid))
    script.chmod(0o755)
    cxx = str(script) if compiler == "hangs" else "no-such-c++"
    env = dict(CXX=cxx, TREEATTN_BUILD_TIMEOUT="1")
    try:
        result, took = decode_in_child(tmp_path / "cache", "auto", "cpu", limit=60, **env)
    finally:
        if pid.exists() and alive(int(pid.read_text())):
            os.kill(int(pid.read_text()), 9)
    check_decode(result["auto"])
    assert not result["auto"]["fused"]
    assert result["info"] is None
    error = result["cpu"]["error"]
    assert "backend='cpu' unavailable" in error
    if compiler == "hangs":
        assert f"{script} -O3" in error and "did not finish within 1 s" in error
        assert "TREEATTN_BUILD_TIMEOUT" in error
        assert log.read_text().splitlines()[0] == "--version"
        assert len(log.read_text().splitlines()) == 2  # one compile: not retried for "cpu"
        assert not alive(int(pid.read_text()))  # the compiler's child was killed too
    else:
        assert "$CXX='no-such-c++' is not found" in error
    assert not list((tmp_path / "cache").glob("*.so")) and not list(
        (tmp_path / "cache").glob("*.json")
    )
    assert took < 45, took
    print(f"{compiler}: decode returned after {took:.1f} s")


BAD_COMPILER = """#!/bin/sh
# Exits 0 after writing {what} to the -o file.
if [ "$1" = --version ]; then echo "bad-c++ 1.0"; exit 0; fi
while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done
{write} > "$out"
"""


@pytest.mark.parametrize("what", ["garbage", "half a library"])
def test_a_bad_build_is_not_cached(built, tmp_path, monkeypatch, what):
    """A compiler that succeeds but writes no complete library leaves nothing in the cache (the
    next process tries again) and the error says what it wrote."""
    size = built[0].stat().st_size
    write = "head -c 5000 /dev/urandom" if what == "garbage" else f"head -c {size // 2} {built[0]}"
    script = tmp_path / "bad-c++"
    script.write_text(BAD_COMPILER.format(what=what, write=write))
    script.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(cache))
    expected = "no ELF shared library" if what == "garbage" else "truncated ELF file"
    with pytest.raises(_native.BuildError, match=expected):
        _native._build()
    assert sorted(p.suffix for p in cache.iterdir()) == [".lock"]


def test_compiler_and_timeout_settings(monkeypatch, tmp_path):
    """$CXX is split like a shell command and must exist; the timeout must be positive."""
    monkeypatch.setenv("CXX", f"{shutil.which('c++') or shutil.which('g++')} -DUNUSED")
    assert _native._compiler()[1:] == ["-DUNUSED"]
    monkeypatch.setenv("CXX", "no-such-c++ -O2")
    with pytest.raises(_native.BuildError, match=r"\$CXX='no-such-c\+\+ -O2' is not found"):
        _native._compiler()
    monkeypatch.delenv("TREEATTN_BUILD_TIMEOUT", raising=False)
    assert _native.build_timeout() == _native.DEFAULT_BUILD_TIMEOUT
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("TREEATTN_BUILD_TIMEOUT", bad)
        with pytest.raises(_native.BuildError, match="not a positive number of seconds"):
            _native.build_timeout()


def test_layout_is_a_checked_string_attribute(monkeypatch, tmp_path):
    """The kernel takes the cache layout by name and rejects any other name."""
    monkeypatch.setenv("TREEATTN_CACHE_DIR", str(tmp_path))
    assert _native.load_kernel() is None
    q = jnp.ones((1, 1, 2, 4))
    k = jnp.ones((1, 3, 2, 4))
    ints = jnp.zeros((1,), jnp.int32), jnp.full((1,), 3, jnp.int32), jnp.zeros((1, 0), jnp.int32)
    kw = dict(scale=0.5, causal=False, has_pos=False)
    out, _ = _ffi(q, k, k, *ints, layout="bshd", **kw)
    np.testing.assert_allclose(out, 1.0)
    with pytest.raises(Exception, match="layout must be bshd or bhsd, got sbhd"):
        jax.block_until_ready(_ffi(q, k, k, *ints, layout="sbhd", **kw))


@pytest.mark.slow
def test_concurrent_first_use(tmp_path):
    """Processes that start together on an empty cache (one per host of a multi-process run)
    all load the C++ kernel: one builds, the others wait for it."""
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "TREEATTN_BUILD_TIMEOUT")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TREEATTN_CACHE_DIR=str(tmp_path))
    code = "from treeattn import _native; print(_native.load_kernel())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert [o.strip() for o in outputs] == ["None"] * 3
    (lib,) = tmp_path.glob("*.so")
    assert _native._verify(lib, lib.with_suffix(".json")) is None
