"""Training a small language model with optax, with checkpoints to resume from."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from ..decode import AttentionBackend, AttentionName
from ..pretrained import CharTokenizer


if TYPE_CHECKING:
    # The loop takes a model, it does not build one (`type(model)` loads a checkpoint), so
    # `treeattn.models` can offer its deprecated aliases without an import cycle.
    from ..models import Transformer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation: AdamW with linear warm-up then cosine decay, global-norm clipping."""

    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    final_learning_rate: float = 3e-4
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 500

    def optimizer(self) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            self.learning_rate,
            self.warmup_steps,
            max(self.steps, self.warmup_steps + 1),
            self.final_learning_rate,
        )

        def decay_mask(params):
            # Decay the weights of linear and embedding layers, not biases or norm gains. By
            # name, not by rank: the stacked layers make every gain and bias 2-d.
            def decays(path, _):
                names = [getattr(k, "name", "") for k in path]
                return names[-1] == "weight" and not names[-2].endswith("norm")

            return jax.tree_util.tree_map_with_path(decays, params)

        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(schedule, weight_decay=self.weight_decay, mask=decay_mask),
        )


def lm_loss(
    model: Transformer,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    backend: AttentionBackend | None = None,
    *,
    segment_ids: Int[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy over a batch.

    With `segment_ids` (the document of each input token; rows of packed documents, each
    contiguous) the model attends within documents, and a target counts only when it belongs
    to its input's document: `targets[:, t]` is taken to be `inputs[:, t + 1]`, so the last
    token of a document does not predict the first of the next. The mean is over the targets
    that count."""
    if segment_ids is None:
        logits = jax.vmap(lambda x: cast(Array, model(x, backend=backend)))(inputs)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    if jnp.shape(segment_ids) != jnp.shape(inputs):
        raise ValueError(
            f"lm_loss: segment_ids must have the shape of inputs {jnp.shape(inputs)}, got "
            f"{jnp.shape(segment_ids)}"
        )

    def row(x, seg):
        return cast(Array, model(x, backend=backend, segment_ids=seg))

    logits = jax.vmap(row)(inputs, segment_ids).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    # The target of the last position lies beyond the row: it counts (a row cut from a stream).
    within = jnp.concatenate(
        [segment_ids[:, 1:] == segment_ids[:, :-1], jnp.ones_like(segment_ids[:, :1], bool)],
        axis=1,
    )
    count = jnp.maximum(jnp.sum(within), 1).astype(losses.dtype)
    return jnp.sum(jnp.where(within, losses, 0.0)) / count


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """Random windows of `seq_len + 1` tokens, forever."""
    rng = np.random.default_rng(seed)
    if len(tokens) <= seq_len:
        raise ValueError(f"train: the text ({len(tokens)} tokens) must exceed seq_len={seq_len}")
    while True:
        starts = rng.integers(0, len(tokens) - seq_len, batch_size)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def train(
    model: Transformer,
    tokens: np.ndarray,
    config: TrainConfig = TrainConfig(),
    *,
    backend: AttentionName | AttentionBackend | None = None,
    checkpoint_dir: str | pathlib.Path | None = None,
    tokenizer: CharTokenizer | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[Transformer, list[float]]:
    """Train `model` on random windows of `tokens` with optax; returns it and the losses.

    `backend` chooses the attention used in training (`"energy"` trains through the gradient of
    the free energy: a second derivative of F). With `checkpoint_dir`, the model (Hugging Face
    format), the tokenizer, the optimiser state and the step are written every
    `config.checkpoint_every` steps and at the end; training resumes from them if present.
    """
    be = None if backend is None else AttentionBackend.of(backend)
    optimizer = config.optimizer()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(params)
    start = 0
    if checkpoint_dir is not None:
        state_file = pathlib.Path(checkpoint_dir) / "train_state.eqx"
        if state_file.exists():
            meta = json.loads((pathlib.Path(checkpoint_dir) / "train_state.json").read_text())
            model = type(model).from_pretrained(
                checkpoint_dir,
                backend=model.backend,
                dtype=model.embed_tokens.weight.dtype,
            )
            params, static = eqx.partition(model, eqx.is_inexact_array)
            # The optimiser state mirrors the parameters' pytree: rebuild it from the loaded model.
            with jax.numpy_dtype_promotion("standard"):
                opt_state = optimizer.init(params)
            opt_state = eqx.tree_deserialise_leaves(state_file, opt_state)
            start = meta["step"]

    @eqx.filter_jit
    def step(params, opt_state, x, y):
        def loss(p):
            return lm_loss(eqx.combine(p, static), x, y, be)

        value, grads = jax.value_and_grad(loss)(params)
        # optax mixes its integer step count with floats, which strict promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    data = batches(tokens, config.batch_size, config.seq_len, config.seed)
    for _ in range(start):  # resume: the same data order as an uninterrupted run
        next(data)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=start, desc="train", unit="step")
    losses: list[float] = []
    for i in range(start, config.steps):
        x, y = next(data)
        params, opt_state, value = step(params, opt_state, jnp.asarray(x), jnp.asarray(y))
        loss = float(value)
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        done = i + 1 == config.steps
        if checkpoint_dir is not None and ((i + 1) % config.checkpoint_every == 0 or done):
            save_checkpoint(
                cast("Transformer", eqx.combine(params, static)),
                checkpoint_dir,
                tokenizer=tokenizer,
                opt_state=opt_state,
                step=i + 1,
            )
    if bar is not None:
        bar.close()
    return cast("Transformer", eqx.combine(params, static)), losses


def save_checkpoint(
    model: Transformer,
    path: str | pathlib.Path,
    *,
    tokenizer: CharTokenizer | None = None,
    opt_state=None,
    step: int | None = None,
) -> None:
    path = pathlib.Path(path)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save(path)
    if opt_state is not None:
        eqx.tree_serialise_leaves(path / "train_state.eqx", opt_state)
        (path / "train_state.json").write_text(json.dumps({"step": step}))
