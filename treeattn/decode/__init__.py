"""Fused local attention with `(out, lse)`, tree decoding (Algorithm 3), the ring baseline."""

from ._backends import (
    BACKENDS as BACKENDS,
    BackendUnavailable as BackendUnavailable,
    flash_attention as flash_attention,
    flash_attention_reference as flash_attention_reference,
    select_backend as select_backend,
)
from ._ring import ring_decode as ring_decode
from ._tree import tree_decode as tree_decode
