"""Fused local attention with `(out, lse)`, tree decoding (Algorithm 3), the ring baseline."""

from .. import distributed as _distributed
from .._deprecated import moved
from .._numerics import Layout as Layout
from ._backend import (
    AttentionBackend as AttentionBackend,
    AttentionName as AttentionName,
    Schedule as Schedule,
    cache_layout as cache_layout,
)
from ._cost_model import (
    DGX_H100 as DGX_H100,
    Cluster as Cluster,
    DecodeCost as DecodeCost,
    cost_model as cost_model,
)
from ._dpa import (
    EMPTY_ROWS as EMPTY_ROWS,
    EmptyRows as EmptyRows,
    dot_product_attention as dot_product_attention,
)
from ._flash import (
    flash_attention as flash_attention,
    flash_attention_reference as flash_attention_reference,
)
from ._registry import (
    BACKENDS as BACKENDS,
    Backend as Backend,
    BackendUnavailable as BackendUnavailable,
    select_backend as select_backend,
)
from ._ring import ring_decode as ring_decode
from ._tree import tree_decode as tree_decode


# Names of `treeattn.distributed` also reachable here, as deprecated aliases.
__getattr__ = moved(
    "treeattn.decode",
    dict.fromkeys(
        (
            "ProcessConfig",
            "check_devices",
            "initialize",
            "kv_mesh",
            "node_mesh",
            "process_config_from_env",
        ),
        _distributed,
    ),
)
