"""The free energy of attention: attention as its gradient, cumulants, the likelihood view."""

from .._partials import (
    LOG_AFFINE as LOG_AFFINE,
    LOGSUMEXP as LOGSUMEXP,
    SUM as SUM,
    Monoid as Monoid,
    Reduction as Reduction,
    allreduce_partials as allreduce_partials,
    allreduce_sum as allreduce_sum,
    merge_partials as merge_partials,
    product as product,
)
from ._composite import (
    PAIR_LOGSUMEXP as PAIR_LOGSUMEXP,
    Differential as Differential,
    Forgetting as Forgetting,
    Softpick as Softpick,
    forgetting_inputs as forgetting_inputs,
)
from ._diagnostics import (
    attention_entropy as attention_entropy,
    received_attention as received_attention,
    tree_attention_entropy as tree_attention_entropy,
    tree_received_attention as tree_received_attention,
)
from ._energies import (
    Context as Context,
    CosFormer as CosFormer,
    Energy as Energy,
    LinearKernel as LinearKernel,
    ScoreMod as ScoreMod,
    Sigmoid as Sigmoid,
    Softmax as Softmax,
    SoftmaxWithSink as SoftmaxWithSink,
    StickBreaking as StickBreaking,
    elu_plus_one as elu_plus_one,
    is_plain_softmax as is_plain_softmax,
)
from ._free_energy import (
    attention_reference as attention_reference,
    causal_free_energy as causal_free_energy,
    energy_attention as energy_attention,
    free_energy as free_energy,
    masked_logsumexp as masked_logsumexp,
    multihead_free_energy as multihead_free_energy,
    value_covariance as value_covariance,
    value_moments as value_moments,
)
from ._likelihood import (
    TiltedSource as TiltedSource,
    log_likelihood as log_likelihood,
    tilted_source as tilted_source,
)
from ._linear_state import LinearState as LinearState
from ._partial import (
    energy_partial as energy_partial,
    energy_partial_reference as energy_partial_reference,
)
from ._sharded import (
    sharded_energy_attention as sharded_energy_attention,
    sharded_free_energy as sharded_free_energy,
    tree_energy_attention as tree_energy_attention,
    tree_free_energy as tree_free_energy,
)
