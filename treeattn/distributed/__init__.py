"""Process start-up and meshes for runs that span several processes or hosts."""

from ._process import (
    ProcessConfig as ProcessConfig,
    check_devices as check_devices,
    free_port as free_port,
    initialize as initialize,
    kv_mesh as kv_mesh,
    node_mesh as node_mesh,
    process_config_from_env as process_config_from_env,
)
