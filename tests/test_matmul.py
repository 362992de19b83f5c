"""The model's matrix product: values, every transform, and the weight read as it lies on CPU."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TOL
from jax.test_util import check_grads

from treeattn._native import load_kernel
from treeattn.models import (
    LlamaConfig,
    MultiheadAttention,
    PackedWeight,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    Transformer,
)
from treeattn.models._layers import (
    _gated_reference,
    _xla_rows,
    apply_linears,
    gated_fuses,
    gated_product,
    matmul,
    mlp_block,
    qkv_block,
    qkv_fuses,
)


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
def test_without_the_cpu_kernel_few_float32_rows_are_multiplied_as_columns(rows, as_columns):
    """Where the C++ product is not built, a few float32 rows (a decode step of a batch) go
    through XLA:CPU's product as contiguous columns, `w @ x.T`, which streams the weight
    faster than `x @ w.T`: the compiled program holds a `[out, rows]` product, not folded back
    into `[rows, out]`."""
    x = jnp.ones((rows, 64), jnp.float32)
    w = jnp.ones((128, 64), jnp.float32)
    text = jax.jit(_xla_rows).lower(x, w).compile().as_text()
    products = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} dot\(", text)
    assert products, text
    assert (products == [f"128,{rows}"]) == as_columns, products


def entry_ops(decoder) -> int:
    """The operations a decoder's compiled step runs one by one (fusions, calls, copies; not
    parameters, tuple elements or views)."""
    text = decoder.compiled_step().as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    free = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple"}
    ops = (re.search(r"\s([\w-]+)\(", line.split("=", 1)[1]) for line in entry.splitlines()[1:])
    return sum(1 for m in ops if m and m[1] not in free)


def matmul_calls(text: str, target: str = "treeattn_cpu_matmul") -> list[int]:
    """The C++ product calls of a compiled program: the number of weights of each."""
    calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    return [line.split("custom-call(")[1].split(")")[0].count("%") - 1 for line in calls]


needs_kernel = pytest.mark.skipif(
    jax.default_backend() != "cpu" or load_kernel() is not None,
    reason="the C++ product runs on a CPU process where it builds",
)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 32, 33])
def test_few_rows_on_cpu_are_one_kernel_call(rows):
    """1 to 32 rows: one call of the C++ product, no XLA dot; more: XLA's product."""
    x = jnp.ones((rows, 64), jnp.float32)
    w = jnp.ones((128, 64), jnp.float32)
    text = jax.jit(matmul).lower(x, w).compile().as_text()
    assert matmul_calls(text) == ([1] if rows <= 32 else [])
    assert (" dot(" in text) == (rows > 32)


@needs_kernel
def test_a_layer_projects_q_k_v_in_one_call_and_gate_up_in_another():
    """A decoder layer's step: q, k, v are one product call of three weights, gate and up one
    of two, then o, down (and the head) one each: the threads start four times per layer."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Transformer(config, key=jax.random.key(0)).unstack_layers()
    params, static = eqx.partition(model, eqx.is_array)
    step = jax.jit(lambda p, t: eqx.combine(p, static)(t))
    text = step.lower(params, jnp.zeros((1,), jnp.int32)).compile().as_text()
    assert sorted(matmul_calls(text)) == sorted([3, 1, 2, 1] * 2 + [1])
    cross = MultiheadAttention(4, 64, key=jax.random.key(1))
    x, y = jnp.ones((1, 64)), jnp.ones((1, 64))
    text = jax.jit(lambda a, b: cross(a, b, b, inference=True)).lower(x, y).compile().as_text()
    assert sorted(matmul_calls(text)) == [1, 1, 1, 1]  # queries and keys of other inputs


def test_grouped_products_match_one_by_one(getkey):
    """`apply_linears`: projections of one dtype in one call, of mixed dtypes one each; the
    biases added; values and derivatives those of the projections one by one."""
    x = jax.random.normal(getkey(), (3, 16))
    projs = tuple(
        eqx.nn.Linear(16, n, use_bias=bias, key=getkey(), dtype=dtype)
        for n, bias, dtype in [
            (8, True, jnp.float32),
            (5, False, jnp.float32),
            (7, True, jnp.bfloat16),
        ]
    )
    got = apply_linears(projs, x)
    for y, p in zip(got, projs, strict=True):
        with jax.numpy_dtype_promotion("standard"):
            want = jax.vmap(p)(x.astype(jnp.result_type(x, p.weight)))
        np.testing.assert_allclose(
            np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
        )
    same = projs[:2]
    loss = lambda ps, x: sum(jnp.sum(jnp.sin(y)) for y in apply_linears(ps, x))  # noqa: E731
    alone = lambda ps, x: sum(jnp.sum(jnp.sin(jax.vmap(p)(x))) for p in ps)  # noqa: E731
    g1 = jax.grad(loss, argnums=(0, 1))(same, x)
    g2 = jax.grad(alone, argnums=(0, 1))(same, x)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Packed weights
# ---------------------------------------------------------------------------------------------

# (out, in): a partial last panel, several partial tiles of panels, and a weight large enough
# to be cut into chunks over the threads; float32 takes an odd number of inputs too.
PACKED_SHAPES = [(24, 16), (37, 64), (300, 256), (16, 7)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [(1,), (3,), (8,), (2, 5), (12,), (33,), (70,)])
def test_packed_matches_float64(rows, shape, dtype, getkey):
    out, n = shape
    x = jax.random.normal(getkey(), (*rows, n), dtype)
    w = jax.random.normal(getkey(), (out, n), dtype)
    if dtype == jnp.bfloat16 and n % 2:  # bfloat16 packs pairs of inputs: an odd count is refused
        assert not PackedWeight.packs(w)
        with pytest.raises(ValueError, match="even number of columns"):
            PackedWeight.of(w)
        return
    packed = PackedWeight.of(w)
    got = jax.jit(matmul)(x, packed)
    assert got.shape == (*rows, out) and got.dtype == dtype
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=PRODUCT_TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_layout_rows_and_casts(dtype, getkey):
    """The documented layout, `unpack` back to the array, rows read as `w[i]` reads them
    (negative from the end, out of range the nearest), and a cast that packs the cast array."""
    w = jax.random.normal(getkey(), (37, 6), dtype)
    packed = PackedWeight.of(w)
    assert packed.shape == (37, 6) and packed.dtype == dtype
    panels, wn = np.asarray(packed.panels, np.float32), np.asarray(w, np.float32)
    if dtype == jnp.bfloat16:
        assert panels.shape == (3, 3, 16, 2)
        assert panels[2, 1, 4, 1] == wn[36, 3] and panels[0, 2, 3, 0] == wn[3, 4]
    else:
        assert panels.shape == (3, 6, 16)
        assert panels[2, 3, 4] == wn[36, 3] and panels[0, 4, 3] == wn[3, 4]
    assert not panels[2, :, 5:].any()  # the padding of the last panel
    np.testing.assert_array_equal(np.asarray(packed.unpack(), np.float32), wn)
    ids = jnp.array([0, 5, 16, 36, -1, -37, 37, 1000, -1000])
    want = np.asarray(w[ids], np.float32)
    np.testing.assert_array_equal(np.asarray(jax.vmap(packed.__getitem__)(ids), np.float32), want)
    np.testing.assert_array_equal(
        np.asarray(packed[ids.reshape(3, 3)], np.float32).reshape(9, 6), want
    )
    np.testing.assert_array_equal(np.asarray(packed[-2], np.float32), wn[-2])
    for i in (37, -38):
        with pytest.raises(IndexError, match="of 37 rows"):
            packed[i]
    other = jnp.float32 if dtype == jnp.bfloat16 else jnp.bfloat16
    assert packed.astype(dtype) is packed
    wide = packed.astype(jnp.float16)  # not packable: the array
    assert isinstance(wide, jax.Array) and wide.shape == (37, 6)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(w.astype(jnp.float16)))
    np.testing.assert_array_equal(
        np.asarray(packed.astype(other).panels, np.float32),
        np.asarray(PackedWeight.of(w.astype(other)).panels, np.float32),
    )


@pytest.mark.parametrize(
    ("w", "what"),
    [
        (jnp.ones((8, 5), jnp.bfloat16), "bfloat16\\[8, 5\\]"),
        (jnp.ones((2, 8, 4)), "float32\\[2, 8, 4\\]"),
        (jnp.ones((8, 4), jnp.int32), "int32\\[8, 4\\]"),
    ],
)
def test_packed_refuses_what_it_cannot_pack(w, what):
    assert not PackedWeight.packs(w)
    with pytest.raises(ValueError, match=f"PackedWeight.of: w must be .*got {what}"):
        PackedWeight.of(w)


@pytest.mark.parametrize("rows", [(1,), (4,), (40,)])
def test_packed_derivatives(rows, getkey):
    """Derivatives in `x` and in the packed weight are those of the array's, packed; and
    first order against finite differences (float32, whose second differences are noise)."""
    x = jax.random.normal(getkey(), (*rows, 6))
    w = jax.random.normal(getkey(), (20, 6))
    packed = PackedWeight.of(w)
    f = lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))  # noqa: E731
    gx, gw = jax.grad(f, argnums=(0, 1))(x, w)
    px, pw = jax.grad(f, argnums=(0, 1))(x, packed)
    np.testing.assert_allclose(px, gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pw.unpack(), gw, rtol=1e-5, atol=1e-5)
    check_grads(matmul, (x, packed), order=1, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2)


def test_packed_vmap_over_rows_and_over_weights(getkey):
    x = jax.random.normal(getkey(), (3, 1, 8))
    ws = jax.random.normal(getkey(), (3, 20, 8))
    packed = jax.vmap(PackedWeight.of)(ws)
    assert packed.shape == (20, 8)  # the shape of one member
    close = {"rtol": 1e-5, "atol": 1e-5}
    one = PackedWeight.of(ws[0])
    np.testing.assert_allclose(jax.vmap(matmul, (0, None))(x, one), x @ ws[0].T, **close)
    np.testing.assert_allclose(jax.vmap(matmul)(x, packed), x @ jnp.swapaxes(ws, 1, 2), **close)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 33, 512])
def test_packed_rows_are_one_kernel_call(rows):
    """Any number of rows: one call of the packed C++ product, reading the panels as they lie
    (no other weight-sized buffer, no XLA product)."""
    x = jnp.ones((rows, 64), jnp.float32)
    packed = PackedWeight.of(jnp.ones((128, 64), jnp.float32))
    text = jax.jit(matmul).lower(x, packed).compile().as_text()
    assert matmul_calls(text, "treeattn_cpu_matmul_packed") == [1]
    assert matmul_calls(text) == [] and " dot(" not in text
    entry = text[text.index("\nENTRY") :].splitlines()[1:]
    made = [line for line in entry if "parameter(" not in line]
    sized = r"= f32\[(8,64,16|64,8,16|128,64|64,128)\]"
    assert not [line for line in made if re.search(sized, line)], made


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [(1,), (8,), (2, 5)])
def test_a_layer_of_a_stack_matches_float64(rows, dtype, getkey):
    """`PackedWeight(stack, out, i)` is layer i's weight wherever a weight is read: the C++
    product (which reads the stack in place), XLA's product on the panels, `unpack`, rows,
    and derivatives in `x`."""
    x = jax.random.normal(getkey(), (*rows, 64), dtype)
    ws = jax.random.normal(getkey(), (3, 37, 64), dtype)
    stack = jax.vmap(PackedWeight.of)(ws).panels
    for i in range(3):
        w = PackedWeight(stack, 37, i)
        assert w.shape == (37, 64) and w.dtype == dtype
        want = np.asarray(x, np.float64) @ np.asarray(ws[i], np.float64).T
        atol = PRODUCT_TOL[dtype] * np.abs(want).max()
        for got in (jax.jit(matmul)(x, w), w.dot(x)):
            assert got.shape == (*rows, 37) and got.dtype == dtype
            np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol)
        np.testing.assert_array_equal(np.asarray(w.unpack()), np.asarray(ws[i]))
        np.testing.assert_array_equal(np.asarray(w[jnp.array([0, 36])]), np.asarray(ws[i][::36]))
    if dtype == jnp.float32:
        w = PackedWeight(stack, 37, 1)
        f = lambda x: jnp.sum(jnp.sin(matmul(x, w)))  # noqa: E731
        g = jax.grad(lambda x: jnp.sum(jnp.sin(x @ ws[1].T)))(x)
        # Two float32 sums of 37 terms in different orders: held to the gradient's scale.
        np.testing.assert_allclose(jax.grad(f)(x), g, atol=1e-5 * np.abs(g).max())
    for panels, i in ((stack, 3), (stack, -1), (stack[0], 0)):
        with pytest.raises(ValueError, match=rf"layer {i} of a stack of panels with a layer axis"):
            PackedWeight(panels, 37, i)


@needs_kernel
def test_a_layer_of_a_stack_is_read_in_place():
    """The C++ product takes the whole stack and the layer's index: no slice of it is made."""
    x = jnp.ones((8, 64), jnp.float32)
    stack = jax.vmap(PackedWeight.of)(jnp.ones((4, 128, 64), jnp.float32)).panels
    text = jax.jit(lambda x, s: matmul(x, PackedWeight(s, 128, 2))).lower(x, stack).compile()
    text = text.as_text()
    assert matmul_calls(text, "treeattn_cpu_matmul_packed") == [1]
    call = next(line for line in text.splitlines() if "treeattn_cpu_matmul_packed" in line)
    assert "f32[4,8,64,16]" in call and "layers = dense<2>" in call  # the stack, layer 2
    # Layers of a stack and a weight of its own in one call: each read where it lies.
    w = jax.random.normal(jax.random.key(0), (16, 64))
    ws = jax.random.normal(jax.random.key(1), (4, 128, 64))
    stack = jax.vmap(PackedWeight.of)(ws).panels
    mixed = (PackedWeight(stack, 128, 3), PackedWeight.of(w), PackedWeight(stack, 128, 0))
    run = jax.jit(lambda x, ps: apply_linears(ps, x))
    linears = [eqx.nn.Linear(64, p.shape[0], use_bias=False, key=jax.random.key(0)) for p in mixed]
    linears = [eqx.tree_at(lambda m: m.weight, m, p) for m, p in zip(linears, mixed, strict=True)]
    x = jax.random.normal(jax.random.key(2), (8, 64))
    text = run.lower(x, linears).compile().as_text()
    assert matmul_calls(text, "treeattn_cpu_matmul_packed") == [3]
    for got, want in zip(run(x, linears), (ws[3], w, ws[0]), strict=True):
        np.testing.assert_allclose(got, x @ want.T, rtol=1e-5, atol=1e-4)
    entry = text[text.index("\nENTRY") :].splitlines()[1:]
    made = [line for line in entry if "parameter(" not in line]
    assert not [line for line in made if re.search(r"= f32\[(8,64,16|128,64|64,128)\]", line)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_by_xla_matches_float64(dtype, getkey):
    """The product XLA computes on the panels (the jvp's, and where the C++ one is not built)."""
    x = jax.random.normal(getkey(), (5, 2, 64), dtype)
    w = jax.random.normal(getkey(), (37, 64), dtype)
    got = PackedWeight.of(w).dot(x)
    assert got.shape == (5, 2, 37) and got.dtype == dtype
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=PRODUCT_TOL[dtype] * scale)


@needs_kernel
def test_a_packed_layer_projects_q_k_v_in_one_call():
    """A decoder's prepared model: its projections packed, each layer six calls."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    decoder = Transformer(config, key=jax.random.key(0)).decoder(max_len=8)
    text = decoder.compiled_step().as_text()
    # A layer is six calls (its attention inputs, the k and v writes, attention, the o
    # product, the MLP block with both residual sums) and the rows of its two norms' weights,
    # which its calls read from their stacks.
    deeper = dataclasses.replace(config, num_hidden_layers=4)
    for batch in (None, 8):
        ops = [
            entry_ops(Transformer(c, key=jax.random.key(0)).decoder(max_len=8, batch=batch))
            for c in (config, deeper)
        ]
        assert ops[1] - ops[0] == 2 * 8, (batch, ops)
    packed = "treeattn_cpu_matmul_packed"
    # Each layer's norm, q, k and v products and rotary are one call (its operands: x, the
    # norm's weight, eps, cos, sin and the three weights); then o, and the logits.
    assert matmul_calls(text, "treeattn_cpu_qkv") == [7] * 2
    assert matmul_calls(text, packed) == [1] * 3
    # Each layer's MLP (both residual sums, norm, gate and up, silu, down) is one call: x, the
    # norm's weight, eps, the attention's output and the three weights.
    assert matmul_calls(text, "treeattn_cpu_mlp") == [6] * 2
    assert matmul_calls(text) == [] and "logistic" not in text and "exponential" not in text


def gated_float64(x, wg, wu):
    x, wg, wu = (np.asarray(a, np.float64) for a in (x, wg, wu))
    g, u = x @ wg.T, x @ wu.T
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(24, 16), (37, 64), (300, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [(1,), (3,), (8,), (2, 5), (33,)])
def test_gated_product_matches_float64(rows, shape, dtype, getkey):
    """SwiGLU's gate, silu(x Wg^T) * x Wu^T, in one call on packed weights: against float64,
    as close as the unfused form (gates of both signs, some past exp's range)."""
    out, n = shape
    x = jax.random.normal(getkey(), (*rows, n), dtype)
    wg = jax.random.normal(getkey(), (out, n), dtype) * (30 / n**0.5)
    wu = jax.random.normal(getkey(), (out, n), dtype) / n**0.5
    pg, pu = PackedWeight.of(wg), PackedWeight.of(wu)
    assert gated_fuses(x, pg, pu)
    want = gated_float64(x, wg, wu)
    atol = TOL[dtype] * np.abs(want).max()
    for got in (jax.jit(gated_product)(x, pg, pu), jax.jit(_gated_reference)(x, pg, pu)):
        assert got.shape == (*rows, out) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol)


def test_gated_product_of_a_stack_vmap_and_derivatives(getkey):
    """Layers of a stack read in place; rows batched over shared weights stay one call, an
    ensemble of weights is one product per member; derivatives are the unfused form's."""
    x = jax.random.normal(getkey(), (3, 2, 64))
    ws = jax.random.normal(getkey(), (2, 3, 40, 64)) / 8
    stacks = [jax.vmap(PackedWeight.of)(w).panels for w in ws]
    pg, pu = (PackedWeight(s, 40, 1) for s in stacks)
    want = gated_float64(x, ws[0, 1], ws[1, 1])
    close = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(jax.jit(gated_product)(x, pg, pu), want, **close)
    np.testing.assert_allclose(jax.vmap(gated_product, (0, None, None))(x, pg, pu), want, **close)
    ensemble = [jax.vmap(PackedWeight.of)(w) for w in ws]
    got = jax.vmap(gated_product)(x, *ensemble)
    for i in range(3):
        np.testing.assert_allclose(got[i], gated_float64(x[i], ws[0, i], ws[1, i]), **close)
    f = lambda x, g, u: jnp.sum(jnp.sin(gated_product(x, g, u)))  # noqa: E731
    r = lambda x, g, u: jnp.sum(jnp.sin(_gated_reference(x, g, u)))  # noqa: E731
    for a, b in zip(
        jax.tree.leaves(jax.grad(f, argnums=(0, 1, 2))(x, pg, pu)),
        jax.tree.leaves(jax.grad(r, argnums=(0, 1, 2))(x, pg, pu)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, **close)
    check_grads(gated_product, (x[0], pg, pu), order=1, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2)


def test_gated_product_far_out():
    """silu(g) u for a gate far below 0 and a large u is silu(g) u (float32), not the overflow
    of g u times the sigmoid."""
    x = jnp.ones((1, 16))
    g = PackedWeight.of(jnp.full((16, 16), -80 / 16))  # g u = -8e38 overflows float32
    u = PackedWeight.of(jnp.full((16, 16), 1e37 / 16))
    got = np.asarray(jax.jit(gated_product)(x, g, u), np.float64)
    want = -80 * np.exp(-80.0) / (1 + np.exp(-80.0)) * 1e37
    np.testing.assert_allclose(got, np.full((1, 16), want), rtol=1e-5)


def test_gated_product_refuses_what_it_does_not_fuse(getkey):
    x = jnp.ones((2, 16))
    w = PackedWeight.of(jnp.ones((8, 16)))
    other = PackedWeight.of(jnp.ones((4, 16)))
    for args in ((x, w, other), (x, w, jnp.ones((8, 16))), (x.astype(jnp.bfloat16), w, w)):
        assert not gated_fuses(*args)
        with pytest.raises(ValueError, match="gated_product: x and two packed weights"):
            gated_product(*args)


def mlp_float64(x, g, eps, wg, wu, wd):
    x = np.asarray(x, np.float64)
    n = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(g, np.float64)
    return x + gated_float64(n, wg, wu) @ np.asarray(wd, np.float64).T


def packed_mlp(n, hidden, dtype, key):
    """An RMSNorm and a SwiGLU of random weights, and the SwiGLU with its weights packed."""
    k1, k2 = jax.random.split(key)
    mlp = SwiGLU(n, hidden, dtype=dtype, key=k1)
    norm = eqx.tree_at(
        lambda m: m.weight,
        RMSNorm(n, 1e-5, dtype=dtype),
        (1 + 0.3 * jax.random.normal(k2, (n,))).astype(dtype),
    )
    weights = lambda m: (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)  # noqa: E731
    packed = eqx.tree_at(weights, mlp, tuple(PackedWeight.of(w) for w in weights(mlp)))
    return norm, mlp, packed


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(24, 16), (40, 20), (300, 64), (704, 256)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("rows", [(1,), (8,), (2, 5), (33,)])
def test_mlp_block_matches_float64(rows, shape, dtype, getkey):
    """A pre-norm block's MLP and residual, x + mlp(norm(x)), in one call on packed weights:
    against float64, as close as the unfused form on the arrays (x small beside the MLP's
    part, which the tolerance so holds; widths not a multiple of a vector too)."""
    hidden, n = shape
    norm, mlp, packed = packed_mlp(n, hidden, dtype, getkey())
    x = (0.02 * jax.random.normal(getkey(), (*rows, n))).astype(dtype)
    want = mlp_float64(
        x, norm.weight, norm.eps, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    )
    atol = TOL[dtype] * np.abs(want).max()
    unfused = jax.jit(lambda x: x + mlp(norm(x)))(x)
    for got in (jax.jit(mlp_block)(x, norm, packed), unfused):
        assert got.shape == x.shape and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol)
    # The block's first residual sum folded in: h = x + plus, rounded to x's dtype.
    plus = (0.01 * jax.random.normal(getkey(), x.shape)).astype(dtype)
    h = x + plus
    want = mlp_float64(
        h, norm.weight, norm.eps, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    )
    got = jax.jit(mlp_block)(x, norm, packed, plus)
    assert got.shape == x.shape and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol)


def test_mlp_block_vmap_derivatives_and_fallback(getkey):
    """Rows batched over shared weights stay one call; derivatives are the unfused form's; with
    weights as arrays (training) the block is the unfused computation itself."""
    norm, mlp, packed = packed_mlp(32, 48, jnp.float32, getkey())
    x = jax.random.normal(getkey(), (3, 2, 32))
    want = jax.vmap(lambda x: x + mlp(norm(x)))(x)
    close = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(jax.vmap(mlp_block, (0, None, None))(x, norm, packed), want, **close)
    np.testing.assert_array_equal(mlp_block(x, norm, mlp), x + mlp(norm(x)))
    # With the addend: batched or shared, one call; on arrays the unfused sum.
    plus = jax.random.normal(getkey(), (3, 2, 32))
    f = jax.jit(jax.vmap(mlp_block, (0, None, None, 0)))
    want = jax.vmap(lambda x, p: (x + p) + mlp(norm(x + p)))(x, plus)
    np.testing.assert_allclose(f(x, norm, packed, plus), want, **close)
    text = f.lower(x, norm, packed, plus).compile().as_text()
    assert text.count('custom_call_target="treeattn_cpu_mlp"') == (load_kernel() is None)
    shared = jax.vmap(mlp_block, (0, None, None, None))(x, norm, packed, plus[0])
    h = x + plus[0]
    np.testing.assert_allclose(shared, jax.vmap(lambda h: h + mlp(norm(h)))(h), **close)
    np.testing.assert_array_equal(mlp_block(x, norm, mlp, plus), (x + plus) + mlp(norm(x + plus)))
    g = jax.grad(lambda p: jnp.sum(jnp.sin(mlp_block(x[0], norm, packed, p))))(plus[0])
    r = jax.grad(lambda p: jnp.sum(jnp.sin((x[0] + p) + mlp(norm(x[0] + p)))))(plus[0])
    np.testing.assert_allclose(g, r, **close)
    f = lambda x, m: jnp.sum(jnp.sin(mlp_block(x, norm, m)))  # noqa: E731
    gx, gm = jax.grad(f, argnums=(0, 1))(x[0], packed)
    rx, rm = jax.grad(lambda x, m: jnp.sum(jnp.sin(x + m(norm(x)))), argnums=(0, 1))(x[0], mlp)
    np.testing.assert_allclose(gx, rx, **close)
    np.testing.assert_allclose(gm.down_proj.weight.unpack(), rm.down_proj.weight, **close)
    check_grads(
        lambda x: mlp_block(x, norm, packed),
        (x[0],),
        order=1,
        modes=["fwd", "rev"],
        atol=2e-2,
        rtol=2e-2,
    )


def qkv_float64(x, g, eps, ws, inv_freq, positions):
    """The q, k and v of RMSNorm(x), q and k rotated ("rotate half") at `positions`."""
    x = np.asarray(x, np.float64)
    n = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(g, np.float64)
    q, k, v = (n @ np.asarray(w, np.float64).T for w in ws)
    # The angles as the model forms them, in float32 (at position 5000 their rounding is
    # ~2e-4 rad, beyond float32's tolerance on the rotated values).
    angle = np.asarray(positions, np.float32)[..., None] * inv_freq.astype(np.float32)
    angle = angle.astype(np.float64)  # [*rows, d / 2]
    c, s = np.cos(angle)[..., None, :], np.sin(angle)[..., None, :]

    def turn(y):
        heads = y.reshape(*y.shape[:-1], -1, 2 * inv_freq.shape[0])
        a, b = np.split(heads, 2, axis=-1)
        return np.concatenate([a * c - b * s, b * c + a * s], -1).reshape(y.shape)

    return turn(q), turn(k), v


def packed_qkv(n, heads, kv_heads, d, dtype, key, dv=None):
    """An RMSNorm, q/k/v projections of random weights (as arrays and packed) and a rotary
    (heads of d for q and k, of `dv`, default d, for v)."""
    k1, k2 = jax.random.split(key)
    outs = (heads * d, kv_heads * d, kv_heads * (dv or d))
    projs = tuple(
        eqx.nn.Linear(n, o, use_bias=False, dtype=dtype, key=k)
        for o, k in zip(outs, jax.random.split(k1, 3), strict=True)
    )
    norm = eqx.tree_at(
        lambda m: m.weight,
        RMSNorm(n, 1e-5, dtype=dtype),
        (1 + 0.3 * jax.random.normal(k2, (n,))).astype(dtype),
    )
    packed = tuple(eqx.tree_at(lambda p: p.weight, p, PackedWeight.of(p.weight)) for p in projs)
    return norm, projs, packed, RotaryEmbedding(d, 500.0)


def unfused_qkv(x, norm, projs, rotary, positions):
    """The same as `MultiheadAttention` computes it unfused: norm, products, rotation."""
    q, k, v = apply_linears(projs, norm(x))
    d = rotary.dim
    angles = rotary.angles(positions.reshape(-1))
    angles = tuple(a.reshape(*x.shape[:-1], d) for a in angles)

    def turn(y):
        heads = y.reshape(-1, y.shape[-1] // d, d)
        flat = tuple(a.reshape(-1, d) for a in angles)
        return rotary.rotate(heads, flat).reshape(y.shape)

    return turn(q), turn(k), v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [(20, 2, 1, 8, 8), (64, 4, 2, 16, 12), (256, 4, 1, 64, 64), (96, 3, 3, 32, 40)],
    ids=str,
)
@pytest.mark.parametrize("rows", [(1,), (8,), (2, 5), (33,)])
def test_qkv_block_matches_float64(rows, shape, dtype, getkey):
    """A pre-norm attention's inputs (norm, q/k/v products, rotary) in one call on packed
    weights: against float64, as close as the unfused form on the arrays (positions far
    apart; heads of 8 to 64, widths not a multiple of a vector, value heads of other sizes)."""
    n, heads, kv_heads, d, dv = shape
    norm, projs, packed, rotary = packed_qkv(n, heads, kv_heads, d, dtype, getkey(), dv)
    x = jax.random.normal(getkey(), (*rows, n)).astype(dtype)
    positions = jax.random.randint(getkey(), rows, 0, 5000)
    assert qkv_fuses(x, norm, packed, rotary) and not qkv_fuses(x, norm, projs, rotary)
    ws = tuple(p.weight for p in projs)
    want = qkv_float64(x, norm.weight, norm.eps, ws, rotary.inv_freq(), positions)
    fused = eqx.filter_jit(qkv_block)(x, norm, packed, rotary, positions)
    unfused = eqx.filter_jit(unfused_qkv)(x, norm, projs, rotary, positions)
    for got in (fused, unfused):
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == dtype
            atol = TOL[dtype] * np.abs(w).max()
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=atol)


def test_qkv_block_vmap_stack_and_derivatives(getkey):
    """Rows batched with their own positions over shared weights stay one call, a layer of a
    stack is read in place, an ensemble of weights is one product per member; derivatives
    are the unfused form's."""
    norm, projs, packed, rotary = packed_qkv(32, 4, 2, 8, jnp.float32, getkey())
    x = jax.random.normal(getkey(), (3, 2, 32))
    pos = jnp.array([[7, 8], [300, 301], [0, 1]])
    want = jax.vmap(unfused_qkv, (0, None, None, None, 0))(x, norm, projs, rotary, pos)
    close = {"rtol": 2e-5, "atol": 2e-5}
    rows = jax.vmap(qkv_block, (0, None, None, None, 0))
    f = jax.jit(lambda x, pos: rows(x, norm, packed, rotary, pos))
    got = f(x, pos)
    text = f.lower(x, pos).compile().as_text()
    assert text.count('custom_call_target="treeattn_cpu_qkv"') == (load_kernel() is None)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **close)
    # A shared position for every row (not batched) and the second layer of a stack.
    stacked = tuple(
        eqx.tree_at(
            lambda p: p.weight,
            p,
            PackedWeight(jax.vmap(PackedWeight.of)(jnp.stack([w * 2, w])).panels, w.shape[0], 1),
        )
        for p, w in zip(projs, (p.weight for p in projs), strict=True)
    )
    shared = jax.vmap(qkv_block, (0, None, None, None, None))(x, norm, stacked, rotary, pos[1])
    ref = jax.vmap(unfused_qkv, (0, None, None, None, None))(x, norm, projs, rotary, pos[1])
    for a, b in zip(shared, ref, strict=True):
        np.testing.assert_allclose(a, b, **close)
    # An ensemble: weights batched too.
    members = jax.vmap(lambda k: packed_qkv(32, 4, 2, 8, jnp.float32, k)[2])(
        jax.random.split(getkey(), 3)
    )
    got = jax.vmap(qkv_block, (0, None, 0, None, 0))(x, norm, members, rotary, pos)
    for i in range(3):
        member = jax.tree.map(lambda a: a[i], members)  # noqa: B023
        arrays = tuple(
            eqx.tree_at(lambda p: p.weight, p, p.weight.unpack())  # noqa: B023
            for p in member
        )
        for a, b in zip(got, unfused_qkv(x[i], norm, arrays, rotary, pos[i]), strict=True):
            np.testing.assert_allclose(a[i], b, **close)

    def loss(f):
        return lambda x, p: sum(jnp.sum(jnp.sin(y)) for y in f(x, norm, p, rotary, pos[1]))

    gx, gp = jax.grad(loss(qkv_block), argnums=(0, 1))(x[0], packed)
    rx, rp = jax.grad(loss(unfused_qkv), argnums=(0, 1))(x[0], projs)
    np.testing.assert_allclose(gx, rx, **close)
    for g, r in zip(gp, rp, strict=True):  # the weights' gradients, packed as the weights
        np.testing.assert_allclose(g.weight.unpack(), r.weight, **close)
    check_grads(
        lambda x: qkv_block(x, norm, packed, rotary, pos[1]),
        (x[0],),
        order=1,
        modes=["fwd", "rev"],
        atol=2e-2,
        rtol=2e-2,
    )


def test_qkv_block_refuses_what_it_does_not_fuse(getkey):
    norm, projs, packed, rotary = packed_qkv(32, 4, 2, 8, jnp.float32, getkey())
    x, pos = jnp.ones((2, 32)), jnp.arange(2)
    biased = (eqx.tree_at(lambda p: p.bias, packed[0], jnp.ones(32), is_leaf=lambda b: b is None),)
    for args in (
        (x, norm, projs, rotary),  # weights as arrays
        (x.astype(jnp.bfloat16), norm, packed, rotary),  # dtypes differ
        (x, norm, biased + packed[1:], rotary),  # a bias
        (x, norm, packed, RotaryEmbedding(12)),  # heads of 8, angles of 12
        (x, lambda y: y, packed, rotary),  # not an RMSNorm
    ):
        assert not qkv_fuses(*args)
        with pytest.raises(ValueError, match="qkv_block: an RMSNorm, three projections"):
            qkv_block(*args, pos)
    with pytest.raises(ValueError, match=r"positions must have x's rows' shape \[2\], got \[3\]"):
        qkv_block(x, norm, packed, rotary, jnp.arange(3))


def test_attention_with_norm_is_attention_of_the_normed_input(getkey):
    """`MultiheadAttention(..., norm=)`: the layer over norm(x), fused on packed weights or
    not, with a cache and without; refused for cross-attention."""
    layer = MultiheadAttention(
        4, 32, qk_size=8, vo_size=8, num_kv_heads=2, causal=True,
        rotary=RotaryEmbedding(8), use_query_bias=False, use_key_bias=False,
        use_value_bias=False, use_output_bias=False, key=getkey(),
    )  # fmt: skip
    names = ("query_proj", "key_proj", "value_proj")
    packed = eqx.tree_at(
        lambda m: tuple(getattr(m, n).weight for n in names),
        layer,
        tuple(PackedWeight.of(getattr(layer, n).weight) for n in names),
    )
    norm = eqx.tree_at(lambda m: m.weight, RMSNorm(32), 1 + jax.random.normal(getkey(), (32,)))
    x = jax.random.normal(getkey(), (5, 32))
    h = norm(x)
    close = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(layer(x, x, x, norm=norm), layer(h, h, h), **close)
    np.testing.assert_allclose(packed(x, x, x, norm=norm), layer(h, h, h), **close)
    text = jax.jit(lambda x: packed(x, x, x, norm=norm)).lower(x).compile().as_text()
    assert text.count('custom_call_target="treeattn_cpu_qkv"') == (load_kernel() is None)
    cache = layer.init_cache(8)
    want, want_cache = layer(h, h, h, cache=cache)
    for m in (layer, packed):
        got, got_cache = jax.jit(lambda x, c, m=m: m(x, x, x, cache=c, norm=norm))(x, cache)
        np.testing.assert_allclose(got, want, **close)
        np.testing.assert_allclose(got_cache.k, want_cache.k, **close)
        np.testing.assert_allclose(got_cache.v, want_cache.v, **close)
    with pytest.raises(ValueError, match="norm= is a pre-norm of self-attention"):
        layer(x, h, h, norm=norm)
