"""treeattn: attention as the gradient of a free energy, and tree-reduced decoding over devices."""

import importlib.metadata

from . import (
    decode as decode,
    distributed as distributed,
    energy as energy,
    models as models,
    pretrained as pretrained,
    training as training,
)


__version__ = importlib.metadata.version("treeattn")
