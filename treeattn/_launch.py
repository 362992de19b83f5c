"""`treeattn launch`: N local processes wired together through `jax.distributed` on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
    env: dict[str, str] | None = None,
    out=None,
) -> int:
    """Start `command` as `num_processes` processes of one JAX run and wait for them.

    Each child gets `TREEATTN_COORDINATOR=127.0.0.1:<port>` (a free port unless given),
    `TREEATTN_NUM_PROCESSES`, `TREEATTN_PROCESS_ID` and, with `devices_per_process`,
    `TREEATTN_LOCAL_DEVICES`, which `treeattn.distributed.initialize()` reads. Output lines are
    forwarded with a `[i]` prefix. When a process fails, the others get `grace` seconds to
    stop on their own (JAX's failure detection) and are then terminated; every child is gone
    when this returns, also on Ctrl-C.

    **Returns:** 0 if every process succeeded, else the first non-zero exit status (128 + the
    signal number for a process killed by a signal).
    """
    from .distributed import free_port

    if num_processes < 1:
        raise ValueError(f"launch: -n must be at least 1, got {num_processes}")
    if not command:
        raise ValueError("launch: no command given (put it after --)")
    out = sys.stdout if out is None else out
    port = free_port() if port is None else port
    base = dict(os.environ if env is None else env)
    base["PYTHONUNBUFFERED"] = "1"
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            out.write(line)
            out.flush()

    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []

    def on_term(signum, frame):  # a terminated launcher takes its children with it
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        for i in range(num_processes):
            child_env = dict(base)
            child_env.update(
                TREEATTN_COORDINATOR=f"127.0.0.1:{port}",
                TREEATTN_NUM_PROCESSES=str(num_processes),
                TREEATTN_PROCESS_ID=str(i),
            )
            if devices_per_process is not None:
                child_env["TREEATTN_LOCAL_DEVICES"] = str(devices_per_process)
            proc = subprocess.Popen(
                list(command),
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,  # so that a terminal's Ctrl-C reaches us, not them
            )
            children.append(proc)
            say(f"[launch] process {i} pid {proc.pid}\n")
            pump = threading.Thread(target=_forward, args=(proc, f"[{i}] ", say), daemon=True)
            pump.start()
            pumps.append(pump)
        status = _wait(children, grace, say)
    except BaseException:
        _stop(children, 0.0)
        raise
    finally:
        _stop(children, 2.0)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        for pump in pumps:
            pump.join(timeout=5)
    return status


def _forward(proc: subprocess.Popen, prefix: str, say) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        say(prefix + line if line.endswith("\n") else prefix + line + "\n")


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _wait(children: list[subprocess.Popen], grace: float, say) -> int:
    failed_at = None
    status = 0
    while True:
        codes = [p.poll() for p in children]
        for i, code in enumerate(codes):
            if code not in (None, 0) and status == 0:
                status = _code(code)
                how = f"signal {-code}" if code < 0 else f"status {code}"
                say(f"[launch] process {i} exited with {how}; stopping the run\n")
                failed_at = time.monotonic()
        if all(code is not None for code in codes):
            return status
        if failed_at is not None and time.monotonic() - failed_at > grace:
            alive = [i for i, code in enumerate(codes) if code is None]
            say(f"[launch] terminating processes {alive} ({grace:.0f} s after the failure)\n")
            _stop(children, 5.0)
            return status
        time.sleep(0.1)


def _stop(children: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every live child's process group, then SIGKILL what is left after `timeout`."""
    live = [p for p in children if p.poll() is None]
    for p in live:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.wait()


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
