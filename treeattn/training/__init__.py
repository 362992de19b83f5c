"""Training a language model with optax: the loop that reproduces the shipped checkpoint,
with checkpoints to resume from. The models are Equinox modules: any optax loop trains them;
this one is the reference the shipped checkpoint was made with."""

from ._train import TrainConfig as TrainConfig, lm_loss as lm_loss, train as train
