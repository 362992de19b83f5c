"""Several processes on 127.0.0.1 (jax.distributed, gloo): same answers as one process, bounded
failure, clear configuration errors, and a launcher that cleans up after itself."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import multihost_worker as worker
import numpy as np
import pytest
from helpers import mesh_of

from treeattn.distributed import ProcessConfig, free_port, initialize, process_config_from_env


HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "multihost_worker.py")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TREEATTN_", "XLA_FLAGS"))}
    e.update(JAX_PLATFORMS="cpu", TREEATTN_HEARTBEAT_TIMEOUT="10", **extra)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), e.get("PYTHONPATH", "")])
    return e


def launch(n, devices, *args, timeout=240, **popen):
    cmd = [sys.executable, "-m", "treeattn", "launch", "-n", str(n)]
    cmd += ["--devices-per-process", str(devices), "--", sys.executable, WORKER, *args]
    return subprocess.Popen(
        cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def single_process():
    """The answer of one process with 8 simulated devices."""
    mesh = mesh_of(8)
    return worker.compute(mesh)


@pytest.mark.slow
def test_processes_agree_with_one_process(single_process, tmp_path):
    """Four processes of two devices each: the reduction crosses processes at more than one
    level."""
    out_file = tmp_path / "result.npz"
    proc = launch(4, 2, "result", str(out_file))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    got = np.load(out_file)
    assert int(got["devices"]) == 8
    out, tokens = single_process
    np.testing.assert_allclose(got["out"], out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["tokens"], tokens)


@pytest.mark.slow
def test_a_killed_process_stops_the_run(tmp_path):
    """Kill one process mid-run: launch reports it, the others are gone within 60 s."""
    proc = launch(2, 2, "hang")
    pids, lines = {}, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[launch] process"):
            parts = line.split()
            pids[int(parts[2])] = int(parts[4])
        if "process 1: step 3" in line:
            break
    else:
        pytest.fail("".join(lines[-40:]))
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    rest, _ = proc.communicate(timeout=90)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "process 1 exited with signal 9" in rest
    assert not any(alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_survivors_stop_without_the_launcher():
    """Without `launch`, JAX's heartbeat stops the survivors: a clear error, not a hang."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "hang"],
            env=env(
                TREEATTN_COORDINATOR=f"127.0.0.1:{port}",
                TREEATTN_NUM_PROCESSES="2",
                TREEATTN_PROCESS_ID=str(i),
                TREEATTN_LOCAL_DEVICES="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            if "step 2" in line:
                break
        procs[1].kill()
        start = time.monotonic()
        rest, _ = procs[0].communicate(timeout=90)
        assert time.monotonic() - start < 60
        assert procs[0].returncode != 0
        assert "another task died" in rest
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_launch_terminated_takes_its_children():
    proc = launch(2, 1, "hang")
    pids = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("[launch] process"):
            pids.append(int(line.split()[4]))
        if "step 1" in line:
            break
    proc.terminate()
    proc.communicate(timeout=30)
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.mark.slow
def test_mismatched_device_counts_are_named():
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "result", "/dev/null"],
            env=env(
                TREEATTN_COORDINATOR=f"127.0.0.1:{port}",
                TREEATTN_NUM_PROCESSES="2",
                TREEATTN_PROCESS_ID=str(i),
                TREEATTN_LOCAL_DEVICES=str(i + 1),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    assert "processes have different numbers of devices {0: 1, 1: 2}" in outputs[0]


def test_coordinator_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port 127.0.0.1:{port} is already in use"):
            initialize(f"127.0.0.1:{port}", 2, 0)


def test_configuration_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="process_id=4 is out of range for num_processes=4"):
        ProcessConfig("127.0.0.1:1234", 4, 4)
    with pytest.raises(ValueError, match="coordinator must be 'host:port'"):
        ProcessConfig("127.0.0.1:99999", 2, 0)
    with pytest.raises(ValueError, match="set TREEATTN_COORDINATOR, TREEATTN_NUM_PROCESSES"):
        process_config_from_env({"TREEATTN_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="TREEATTN_NUM_PROCESSES='two' is not an integer"):
        process_config_from_env(
            {
                "TREEATTN_COORDINATOR": "h:1",
                "TREEATTN_NUM_PROCESSES": "two",
                "TREEATTN_PROCESS_ID": "0",
            }
        )
    with pytest.raises(ValueError, match="give coordinator, num_processes and process_id"):
        initialize("127.0.0.1:1234", 2)


def test_environment_detection():
    assert process_config_from_env({}) is None
    explicit = process_config_from_env(
        {
            "TREEATTN_COORDINATOR": "10.0.0.1:1234",
            "TREEATTN_NUM_PROCESSES": "4",
            "TREEATTN_PROCESS_ID": "3",
            "TREEATTN_LOCAL_DEVICES": "2",
        }
    )
    assert explicit == ProcessConfig("10.0.0.1:1234", 4, 3, 2, "explicit")
    slurm = process_config_from_env(
        {"SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[03-06,9],x1"}
    )
    assert slurm == ProcessConfig("gpu03:29417", 16, 5, None, "slurm")
    mpi = process_config_from_env(
        {
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_RANK": "1",
            "TREEATTN_COORDINATOR": "head",
        }
    )
    assert mpi == ProcessConfig("head:29417", 2, 1, None, "openmpi")
    assert process_config_from_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
