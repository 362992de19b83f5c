"""Several processes, one mesh: `jax.distributed` set up from the environment, two-level meshes.

Tree decoding needs nothing of its own across hosts: JAX's multi-controller runtime makes the
devices of every process one mesh, and `tree_decode`'s collectives (NCCL on GPUs, gloo on CPUs)
cross process boundaries unchanged. This module finds the coordinator, the process count and the
process id (explicit variables, SLURM, Open MPI), checks them, and builds the `("node", "local")`
mesh of the hierarchical schedule.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections import Counter
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


DEFAULT_PORT = 29417

# Variables read, most specific first. TREEATTN_* are what `treeattn launch` sets.
_EXPLICIT = {
    "coordinator": ("TREEATTN_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("TREEATTN_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("TREEATTN_PROCESS_ID", "JAX_PROCESS_ID"),
    "local_devices": ("TREEATTN_LOCAL_DEVICES",),
}


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """Where this process sits in a multi-process run.

    - `coordinator`: `host:port` of process 0's coordination service.
    - `num_processes`, `process_id`: the run's size and this process's rank.
    - `local_devices`: simulated CPU devices for this process (CPU runs only; `None` keeps
      JAX's default), so that `processes x local_devices` devices form the global mesh.
    - `source`: where the values came from (`"arguments"`, `"explicit"`, `"slurm"`,
      `"openmpi"`), for messages.
    """

    coordinator: str
    num_processes: int
    process_id: int
    local_devices: int | None = None
    source: str = "arguments"

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(
                f"num_processes must be at least 1, got {self.num_processes} (from {self.source})"
            )
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id={self.process_id} is out of range for num_processes="
                f"{self.num_processes} (from {self.source}): ids run from 0 to "
                f"{self.num_processes - 1}"
            )
        if self.local_devices is not None and self.local_devices < 1:
            raise ValueError(f"local_devices must be at least 1, got {self.local_devices}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"coordinator must be 'host:port' with a port in 1..65535, got "
                f"{self.coordinator!r} (from {self.source})"
            )

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.coordinator.rpartition(":")[2])


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,9],cpu1` -> `gpu03`."""
    m = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def process_config_from_env(env: Mapping[str, str] | None = None) -> ProcessConfig | None:
    """Read the run's layout from the environment, or `None` for a single-process run.

    In order: explicit variables (`TREEATTN_COORDINATOR`, `TREEATTN_NUM_PROCESSES`,
    `TREEATTN_PROCESS_ID`, `TREEATTN_LOCAL_DEVICES`, or JAX's `JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`); SLURM (`SLURM_NTASKS`, `SLURM_PROCID`, the first
    host of `SLURM_STEP_NODELIST`); Open MPI (`OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`,
    with the coordinator from `TREEATTN_COORDINATOR` or 127.0.0.1 on one host). The port
    defaults to 29417.
    """
    env = os.environ if env is None else env

    def get(key):
        return next((name for name in _EXPLICIT[key] if name in env), None)

    local = get("local_devices")
    local_devices = None if local is None else _int(env, local)
    coord, num, pid = get("coordinator"), get("num_processes"), get("process_id")
    if num is not None or pid is not None:
        missing = [k for k, v in (("num_processes", num), ("process_id", pid)) if v is None]
        if missing or coord is None:
            raise ValueError(
                "incomplete multi-process environment: set TREEATTN_COORDINATOR, "
                "TREEATTN_NUM_PROCESSES and TREEATTN_PROCESS_ID together"
            )
        assert num is not None and pid is not None
        return ProcessConfig(
            _with_port(env[coord]), _int(env, num), _int(env, pid), local_devices, "explicit"
        )
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS") > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        host = env[coord] if coord is not None else _first_host(nodes)
        return ProcessConfig(
            _with_port(host),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_PROCID"),
            local_devices,
            "slurm",
        )
    if "OMPI_COMM_WORLD_SIZE" in env and _int(env, "OMPI_COMM_WORLD_SIZE") > 1:
        host = env[coord] if coord is not None else "127.0.0.1"
        return ProcessConfig(
            _with_port(host),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_RANK"),
            local_devices,
            "openmpi",
        )
    return None


def _with_port(address: str) -> str:
    host, sep, port = address.rpartition(":")
    return address if sep and port.isdigit() and host else f"{address}:{DEFAULT_PORT}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port_free(config: ProcessConfig) -> None:
    """Process 0 serves the coordinator: a port in use would otherwise fail deep in gRPC."""
    if config.host not in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()):
        return  # bound on another interface; let JAX report it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1" if config.host == "localhost" else config.host, config.port))
        except OSError as e:
            raise RuntimeError(
                f"the coordinator port {config.coordinator} is already in use ({e.strerror}); "
                f"choose another port (TREEATTN_COORDINATOR=host:port, or let `treeattn launch` "
                f"pick a free one)"
            ) from None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    heartbeat_timeout: int | None = None,
    initialization_timeout: int = 120,
) -> ProcessConfig | None:
    """Join a multi-process run: `jax.distributed.initialize` with defaults that fit treeattn.

    Arguments left `None` come from the environment (see `process_config_from_env`); with
    neither, this is a single-process run and nothing happens (returns `None`). Must run before
    any JAX computation. On CPU it sets the local device count (`local_devices`) and uses gloo
    collectives; on GPUs JAX uses NCCL.

    Failure is bounded: if a process dies, the others stop within about `heartbeat_timeout`
    seconds (default `TREEATTN_HEARTBEAT_TIMEOUT` or 30) with JAX's "another task died" error
    instead of waiting in a collective forever, and a process that cannot reach the
    coordinator gives up after `initialization_timeout` seconds.

    **Returns:** the `ProcessConfig` used, or `None` for a single process.
    """
    if coordinator is None and num_processes is None and process_id is None:
        config = process_config_from_env()
        if config is None:
            if local_devices is not None:
                _set_local_devices(local_devices)
            return None
        if local_devices is not None:
            config = dataclasses.replace(config, local_devices=local_devices)
    else:
        if coordinator is None or num_processes is None or process_id is None:
            raise ValueError("initialize: give coordinator, num_processes and process_id together")
        config = ProcessConfig(_with_port(coordinator), num_processes, process_id, local_devices)
    if config.local_devices is not None:
        _set_local_devices(config.local_devices)
    if config.num_processes == 1:
        return config
    if config.process_id == 0:
        _check_port_free(config)
    if heartbeat_timeout is None:
        heartbeat_timeout = int(os.environ.get("TREEATTN_HEARTBEAT_TIMEOUT", "30"))
    jax.distributed.initialize(
        config.coordinator,
        num_processes=config.num_processes,
        process_id=config.process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )
    check_devices()
    return config


def _set_local_devices(n: int) -> None:
    platforms = jax.config.jax_platforms  # type: ignore[attr-defined]
    if platforms not in (None, "", "cpu"):
        raise ValueError(
            f"local_devices={n} simulates CPU devices, but JAX_PLATFORMS={platforms!r}; "
            "on GPUs each process uses its own devices"
        )
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot set local_devices={n}: JAX has already started its backends; call "
            "treeattn.distributed.initialize before any JAX computation"
        ) from e


def check_devices() -> dict[int, int]:
    """The number of devices of each process; every process must have as many.

    Raises a `ValueError` naming the counts otherwise (a mesh over unequal processes cannot be
    split into equal nodes)."""
    counts = dict(sorted(Counter(d.process_index for d in jax.devices()).items()))
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"processes have different numbers of devices {counts} (process: devices); start "
            "every process with the same device count (e.g. `treeattn launch "
            "--devices-per-process M`)"
        )
    return counts


def node_mesh(
    num_nodes: int | None = None, axis_names: tuple[str, str] = ("node", "local")
) -> Mesh:
    """The two-level mesh over every process's devices, for `reduction="hierarchical"`.

    Rows are nodes (by default one per process: the devices a process owns share a host and
    its fast interconnect), columns the devices of a node. `tree_decode(..., mesh=mesh,
    kv_axis=("node", "local"), reduction="hierarchical")` reduces within each node first,
    then across nodes.
    """
    counts = check_devices()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    num_nodes = len(counts) if num_nodes is None else num_nodes
    if num_nodes < 1 or len(devices) % num_nodes:
        raise ValueError(
            f"node_mesh: {len(devices)} devices cannot be split into num_nodes={num_nodes} "
            "equal nodes"
        )
    grid = np.array(devices, dtype=object).reshape(num_nodes, len(devices) // num_nodes)
    return Mesh(grid, axis_names, axis_types=(AxisType.Auto, AxisType.Auto))


def kv_mesh(axis_name: str = "kv") -> Mesh:
    """A one-axis mesh over every process's devices (in process order), for `tree_decode`'s
    all-reduce schedule and the models' `"tree"` backend."""
    check_devices()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object), (axis_name,), axis_types=(AxisType.Auto,))
