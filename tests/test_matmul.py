"""The model's matrix product: values, every transform, and the weight read as it lies on CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL
from jax.test_util import check_grads

from treeattn.models._layers import matmul


# One product, rounded once: float32 is held to half the table's bound, bfloat16 to the table's.
PRODUCT_TOL = {**TOL, jnp.float32: 1e-5}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [(1,), (3,), (2, 1), (), (2, 16), (33,)])
def test_matches_float64(rows, dtype, getkey):
    x = jax.random.normal(getkey(), (*rows, 16), dtype)
    w = jax.random.normal(getkey(), (24, 16), dtype)  # [out, in], as eqx.nn.Linear holds it
    got = matmul(x, w)
    assert got.shape == (*rows, 24) and got.dtype == dtype
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=PRODUCT_TOL[dtype] * scale)


@pytest.mark.parametrize("batch", [1, 3])
def test_vmap_over_rows_and_over_weights(batch, getkey):
    x = jax.random.normal(getkey(), (batch, 1, 8))
    w = jax.random.normal(getkey(), (5, 8))
    ws = jax.random.normal(getkey(), (batch, 5, 8))
    wts = jnp.swapaxes(ws, 1, 2)
    close = {"rtol": 1e-6, "atol": 1e-6}
    np.testing.assert_allclose(jax.vmap(matmul, (0, None))(x, w), x @ w.T, **close)
    np.testing.assert_allclose(jax.vmap(matmul)(x, ws), x @ wts, **close)
    np.testing.assert_allclose(jax.vmap(matmul, (None, 0))(x[0], ws), x[0] @ wts, **close)
    nested = jax.vmap(jax.vmap(matmul, (0, None)), (0, None))(x[None], w)
    np.testing.assert_allclose(nested[0], x @ w.T, **close)


@pytest.mark.parametrize("rows", [(1,), (4,)])
def test_derivatives(rows, getkey):
    """Second order against finite differences, in float64: second differences in float32
    are noise at the 1e-2 level."""
    with jax.enable_x64(True):
        x = jax.random.normal(getkey(), (*rows, 6), jnp.float64)
        w = jax.random.normal(getkey(), (3, 6), jnp.float64)
        check_grads(matmul, (x, w), order=2, modes=["fwd", "rev"], atol=1e-6, rtol=1e-6)
        batched = jax.vmap(matmul, (0, None))
        x2 = x[None].repeat(2, 0)
        check_grads(batched, (x2, w), order=1, modes=["fwd", "rev"], atol=1e-6, rtol=1e-6)


def weight_sized_buffers(text: str, dtype) -> list[str]:
    """The buffers of the compiled program's entry computation (what it materialises, not
    what a fusion computes in registers) that are a transposed `[64, 128]` weight, or the
    `[128, 64]` weight in another dtype."""
    entry = text[text.index("\nENTRY") :]
    found = []
    for line in entry.splitlines()[1:]:
        m = re.search(r"= (\w+)\[(\d+,\d+)\]", line)
        hlo_dtype = {"float32": "f32", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
        if m and (m[2] == "64,128" or (m[2] == "128,64" and m[1] != hlo_dtype)):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", [None, 1, 4])
def test_the_weight_is_read_as_it_lies(batch, dtype):
    """No transposed or widened copy of the weight: XLA:CPU widens the whole weight to float32
    for a one-row bfloat16 product (so such a product runs over two rows), and a transposed
    weight sends the product down a slower path."""
    x = jnp.ones((1, 64), dtype)
    w = jnp.ones((128, 64), dtype)
    f = matmul if batch is None else jax.vmap(matmul, (0, None))
    x = x if batch is None else jnp.broadcast_to(x, (batch, 1, 64))
    copies = weight_sized_buffers(jax.jit(f).lower(x, w).compile().as_text(), dtype)
    assert copies == [], "\n".join(copies)


def test_the_check_sees_a_widened_weight():
    """The structural check above catches the form it guards against."""
    x = jnp.ones((4, 64), jnp.bfloat16)
    w = jnp.ones((128, 64), jnp.bfloat16)

    def transposed(x, w):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)

    text = jax.jit(transposed).lower(x, w).compile().as_text()
    assert weight_sized_buffers(text, jnp.bfloat16) != []


@pytest.mark.parametrize(("rows", "as_columns"), [(1, False), (8, True), (32, True), (33, False)])
def test_few_float32_rows_are_multiplied_as_columns(rows, as_columns):
    """A few float32 rows (a decode step of a batch) go through XLA:CPU's product as contiguous
    columns, `w @ x.T`, which streams the weight faster than `x @ w.T`: the compiled program
    holds a `[out, rows]` product, not folded back into `[rows, out]`."""
    x = jnp.ones((rows, 64), jnp.float32)
    w = jnp.ones((128, 64), jnp.float32)
    text = jax.jit(matmul).lower(x, w).compile().as_text()
    products = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", text)
    assert products, text
    assert (products == [f"128,{rows}"]) == as_columns, products
