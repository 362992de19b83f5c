"""The GPU paths, checked where there is no GPU: every backend lowered for CUDA from this host.

Lowering for CUDA (`jit(f).trace(...).lower(lowering_platforms=("cuda",))`) runs everything a
GPU run would do before compiling: the choice of kernel for the lowering platform, JAX's and
the kernels' own shape and dtype checks, the Pallas kernel's Triton lowering (for real, block
shapes included) and the custom calls' lowering. A call either lowers with no CPU custom call
in the module, or (for an explicit backend) raises `BackendUnavailable` — and which of the two
happens is what `select_backend(..., platform="cuda")` predicted.

cuDNN checks its version and the GPU's compute capability while tracing, on local devices: the
`cudnn` fixture stubs those two checks (and nothing else), for a Hopper or an Ampere GPU.
The tests at the end run only on a CUDA host (`make test-gpu`): the kernels themselves, against
float64 NumPy.
"""

import functools
import importlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from helpers import TOL, check_out_lse, make_decode_qkv, mesh_of

from treeattn._native import load_kernel
from treeattn.decode import (
    BackendUnavailable,
    dot_product_attention,
    flash_attention,
    select_backend,
    tree_decode,
)
from treeattn.decode._checks import check_decode
from treeattn.decode._gpu import visible_lengths
from treeattn.decode._registry import KERNELS, Call, CudaTarget, host_platform
from treeattn.models import PackedWeight, RMSNorm, RotaryEmbedding, SwiGLU
from treeattn.models._layers import gated_product, mlp_block, qkv_block


S = jax.ShapeDtypeStruct
ON_CUDA = host_platform() == "cuda"
cpu_only = pytest.mark.skipif(ON_CUDA, reason="lowers for CUDA from a host without a GPU")
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU (make test-gpu)")

# Custom calls a CUDA program may hold: Pallas' Triton kernels, cuDNN's attention,
# flash-attn-jax, and XLA's sharding markers.
CUDA_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|__cudnn\$fmha\w*|flash_mha_fwd|Sharding|SPMD\w+")


def custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def lower(f, *args, platform="cuda") -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def assert_cuda_program(text: str):
    calls = custom_calls(text)
    assert not {c for c in calls if not CUDA_CALL.fullmatch(c)}, calls
    assert "treeattn_cpu" not in text


@pytest.fixture(params=["hopper", "ampere"])
def cudnn(request, monkeypatch):
    """JAX's cuDNN version and compute-capability checks answer as a GPU would (cuDNN 9.10 on a
    Hopper or an Ampere GPU); everything else — JAX's shape and dtype checks, the custom call's
    lowering — runs as it is."""
    fas = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    cap = (9, 0) if request.param == "hopper" else (8, 0)
    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(
        fas, "check_compute_capability", lambda c: tuple(map(int, c.split("."))) <= cap
    )
    monkeypatch.setattr(fas, "is_cuda_compute_capability_equal", lambda c: False)
    return request.param


# ---------------------------------------------------------------------------------------------
# The calls lowered: decode (one query, GQA, kv_length, causal offset), a vmapped batch of
# caches, a prefill chunk; head dims 64, 80, 128 and a value dim different from the head dim
# ---------------------------------------------------------------------------------------------

HEADS = {"d64": (64, 64), "d80": (80, 80), "d128": (128, 128), "qk128_dv64": (128, 64)}
CASES = ("decode", "vmapped", "prefill")


def call_of(case: str, dtype, qk: int, dv: int, backend):
    """(f, abstract args, dims) of one call: causal, with a filled length per row."""
    b, h, kh, kv = 2, 8, 2, 512
    q_seq = 16 if case == "prefill" else 1
    q = S((b, q_seq, h, qk), dtype)
    k, v = S((b, kh, kv, qk), dtype), S((b, kh, kv, dv), dtype)
    n = S((b,), jnp.int32)
    if case == "prefill":  # a chunk of 16 queries after a cache prefix, causal

        def f(q, k, v, n):
            return flash_attention(
                q,
                k,
                v,
                kv_layout="bhsd",
                causal=True,
                q_offset=n - 16,
                kv_length=n,
                backend=backend,
            )

    else:

        def f(q, k, v, n):
            return flash_attention(
                q,
                k,
                v,
                kv_layout="bhsd",
                causal=True,
                q_offset=n - 1,
                kv_length=n,
                backend=backend,
            )

    if case == "vmapped":  # several prompts: a batch of caches, vmapped
        f = jax.vmap(f)
        q, k, v, n = (S((3, *x.shape), x.dtype) for x in (q, k, v, n))
    dims = check_decode(
        "t",
        jnp.zeros((b, q_seq, h, qk), dtype),
        jnp.zeros((b, kh, kv, qk), dtype),
        jnp.zeros((b, kh, kv, dv), dtype),
        kv_layout="bhsd",
    )
    return f, (q, k, v, n), dims


def lowers_as_predicted(case, dtype, heads, backend):
    qk, dv = HEADS[heads]
    f, args, dims = call_of(case, dtype, qk, dv, backend)
    try:
        expected = select_backend(
            backend, dims, dtype, causal=True, has_length=True, q_offset=None, platform="cuda"
        )
    except BackendUnavailable as e:
        expected, reason = None, str(e)
    if expected is None:
        with pytest.raises(BackendUnavailable):
            lower(f, *args)
        return None, reason
    text = lower(f, *args)
    assert_cuda_program(text)
    marks = {"pallas": "triton", "cudnn": "__cudnn$fmha", "flash_attn_jax": "flash_mha_fwd"}
    if expected in marks:
        assert any(marks[expected] in c for c in custom_calls(text)), (expected, text[:2000])
    else:
        assert not custom_calls(text) - {"Sharding"}
    return expected, text


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["auto", "pallas", "xla", "reference", "flash_attn_jax", "cpu"])
def test_lowers_for_cuda(case, heads, dtype, backend):
    expected, _ = lowers_as_predicted(case, dtype, heads, backend)
    if backend == "auto":
        # One query per row: the split-K Pallas kernel (head dims padded to a power of two,
        # float32 at full precision); a prefill chunk with a filled length: the portable kernel.
        assert expected == ("xla" if case == "prefill" else "pallas")
    if backend in ("flash_attn_jax", "cpu"):  # never on CUDA from here
        assert expected is None


@cpu_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", ["cudnn", "auto"])
def test_cudnn_lowers_for_cuda(cudnn, case, heads, dtype, backend):
    expected, detail = lowers_as_predicted(case, dtype, heads, backend)
    qk, dv = HEADS[heads]
    if backend == "cudnn":
        if dtype == jnp.float32:  # JAX's check_layout: fp16/bf16 only
            assert expected is None and "float16/bfloat16 only" in detail
        elif case == "prefill":  # its causal mask aligns top-left
            assert expected is None and "top-left" in detail
        elif qk % 8 == 0 and (dv == qk or cudnn == "hopper"):
            assert expected == "cudnn"
            # Its lse is cuDNN's float32 statistics, never rounded to the input dtype.
            assert not re.search(r"xf32>\) -> tensor<[0-9x]*xbf16>", detail)
        else:
            assert expected is None
    else:  # float32 never reaches cuDNN; one query goes to Pallas first
        assert expected != "cudnn" or (dtype == jnp.bfloat16 and case == "prefill")


@cpu_only
def test_cudnn_head_dim_limits(cudnn):
    """Multiples of 8, at most 128 before Hopper and 256 on Hopper (JAX's
    check_is_flash_attention), refused with the reason, not JAX's NotImplementedError."""
    for qk, ok in ((64, True), (80, True), (100, False), (192, cudnn == "hopper"), (264, False)):
        kv = jnp.zeros((2, 2, 64, qk), jnp.bfloat16)
        dims = check_decode("t", jnp.zeros((2, 1, 8, qk), jnp.bfloat16), kv, kv, kv_layout="bhsd")
        kw = dict(causal=False, has_length=True, q_offset=0, platform="cuda")
        if ok:
            assert select_backend("cudnn", dims, jnp.bfloat16, **kw) == "cudnn"
        else:
            with pytest.raises(BackendUnavailable, match=r"multiples of 8 and <= (128|256)"):
                select_backend("cudnn", dims, jnp.bfloat16, **kw)


@cpu_only
def test_cudnn_under_vmap_with_shared_lengths(cudnn):
    """`generate` vmaps over prompts; cuDNN's own batching rule needs every operand batched
    (the query lengths jax builds are not): the adapter owns its batch axis instead."""
    q, k, v = (
        S((3, 2, 1, 8, 64), jnp.bfloat16),
        S((3, 2, 2, 256, 64), jnp.bfloat16),
        S((3, 2, 2, 256, 64), jnp.bfloat16),
    )
    n = S((2,), jnp.int32)

    def f(q, k, v, n):
        return flash_attention(q, k, v, kv_layout="bhsd", kv_length=n, backend="cudnn")

    for in_axes in ((0, 0, 0, None), (0, None, None, None)):
        args = tuple(
            a if axis is not None else S(a.shape[1:], a.dtype)
            for a, axis in zip((q, k, v), in_axes, strict=False)
        ) + (n,)
        text = lower(jax.vmap(f, in_axes=in_axes), *args)
        assert_cuda_program(text)
        assert "__cudnn$fmha" in text


# ---------------------------------------------------------------------------------------------
# One jitted function, every platform; tree decoding on a mesh; a model's decode step
# ---------------------------------------------------------------------------------------------


@cpu_only
def test_one_function_lowers_for_cpu_and_cuda():
    """`auto` is resolved per lowering platform: the same jitted function holds the C++ kernel
    when lowered for CPU and never when lowered for CUDA (or ROCm, where only the portable
    kernel runs)."""
    args = (
        S((2, 1, 8, 64), jnp.float32),
        S((2, 2, 300, 64), jnp.float32),
        S((2, 2, 300, 64), jnp.float32),
        S((2,), jnp.int32),
    )
    f = jax.jit(lambda q, k, v, n: flash_attention(q, k, v, kv_length=n, kv_layout="bhsd"))
    traced = f.trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert_cuda_program(cuda)
    assert "triton" in cuda
    if KERNELS["cpu"].why_not(call(dims_of(args), jnp.float32, "cpu")) is None:
        assert "treeattn_cpu_decode" in custom_calls(
            traced.lower(lowering_platforms=("cpu",)).as_text()
        )
    assert not custom_calls(traced.lower(lowering_platforms=("rocm",)).as_text())
    # The portable kernel lowers for several platforms in one program.
    g = jax.jit(
        lambda q, k, v, n: flash_attention(q, k, v, kv_length=n, kv_layout="bhsd", backend="xla")
    )
    assert not custom_calls(g.trace(*args).lower(lowering_platforms=("cpu", "cuda")).as_text())


@cpu_only
def test_packed_mlp_and_gate_lower_for_cuda_without_the_cpu_kernel():
    """A packed model's fused MLP, gate and attention inputs (the C++ kernel on CPU, what a
    CPU `Decoder` runs) lower for CUDA as their unfused twins, forward and differentiated."""
    mlp = SwiGLU(64, 96, key=jax.random.key(0))
    weights = lambda m: (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)  # noqa: E731
    packed = eqx.tree_at(weights, mlp, tuple(PackedWeight.of(w) for w in weights(mlp)))
    norm = RMSNorm(64)
    x = S((8, 64), jnp.float32)
    block = lambda x: mlp_block(x, norm, packed)  # noqa: E731
    gate = lambda x: gated_product(x, packed.gate_proj.weight, packed.up_proj.weight)  # noqa: E731
    projs = tuple(
        eqx.nn.Linear(64, o, use_bias=False, key=jax.random.key(i))
        for i, o in enumerate((64, 32, 32))
    )
    projs = tuple(eqx.tree_at(lambda p: p.weight, p, PackedWeight.of(p.weight)) for p in projs)
    heads = lambda x: qkv_block(x, norm, projs, RotaryEmbedding(16), jnp.arange(8))  # noqa: E731
    for f in (block, gate, heads, jax.grad(lambda x: jnp.sum(block(x)))):
        assert_cuda_program(lower(f, x))
    assert_cuda_program(lower(jax.grad(lambda x: jnp.sum(heads(x)[1])), x))
    if load_kernel() is None:
        assert "treeattn_cpu_mlp" in custom_calls(lower(block, x, platform="cpu"))
        assert "treeattn_cpu_matmul_gated" in custom_calls(lower(gate, x, platform="cpu"))
        assert "treeattn_cpu_qkv" in custom_calls(lower(heads, x, platform="cpu"))


@cpu_only
def test_explicit_backend_refused_when_lowered_for_its_wrong_platform():
    args = (
        S((2, 1, 8, 64), jnp.float32),
        S((2, 2, 300, 64), jnp.float32),
        S((2, 2, 300, 64), jnp.float32),
        S((2,), jnp.int32),
    )
    f = jax.jit(
        lambda q, k, v, n: flash_attention(q, k, v, kv_length=n, kv_layout="bhsd", backend="cpu")
    )
    with pytest.raises(
        BackendUnavailable, match=r"backend='cpu' unavailable on cuda: it is an XLA:CPU FFI"
    ):
        f.trace(*args).lower(lowering_platforms=("cuda",))
    with pytest.raises(BackendUnavailable, match=r"unavailable on rocm"):
        f.trace(*args).lower(lowering_platforms=("rocm",))


@cpu_only
def test_export_for_cuda_from_a_cpu_host():
    """AOT export for a GPU from this machine: the portable kernel exports as it is; Pallas'
    Triton custom call carries no compatibility guarantee, so exporting it is an explicit
    opt-out of that check."""
    args = (
        S((2, 1, 8, 64), jnp.bfloat16),
        S((2, 2, 256, 64), jnp.bfloat16),
        S((2, 2, 256, 64), jnp.bfloat16),
        S((2,), jnp.int32),
    )

    def f(backend):
        return jax.jit(
            lambda q, k, v, n: flash_attention(
                q, k, v, kv_length=n, kv_layout="bhsd", backend=backend
            )
        )

    exp = jax.export.export(f("xla"), platforms=["cuda"])(*args)
    assert exp.platforms == ("cuda",)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exp = jax.export.export(f("auto"), platforms=["cuda"], disabled_checks=[triton])(*args)
    assert "triton" in exp.mlir_module()


@cpu_only
@pytest.mark.parametrize("backend", ["auto", "pallas", "xla", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_tree_decode_lowers_for_cuda(backend, dtype):
    mesh = mesh_of(4)
    args = (
        S((2, 1, 8, 80), dtype),
        S((2, 2, 512, 80), dtype),
        S((2, 2, 512, 80), dtype),
        S((2,), jnp.int32),
    )

    def f(q, k, v, n):
        return tree_decode(
            q, k, v, mesh=mesh, kv_axis="kv", kv_length=n, kv_layout="bhsd", backend=backend
        )

    if backend == "cpu":
        with pytest.raises(BackendUnavailable, match="unavailable on cuda"):
            lower(f, *args)
        return
    text = lower(f, *args)
    assert_cuda_program(text)
    assert ("triton" in text) == (backend != "xla")
    assert "all-reduce" in text or "all_reduce" in text


@cpu_only
@pytest.mark.parametrize("feature", ["window", "mask", "bias"])
@pytest.mark.parametrize("backend", ["auto", "xla", "reference", "pallas", "cpu"])
@pytest.mark.parametrize("path", ["flash", "tree", "dpa"])
def test_window_mask_bias_lower_for_cuda(path, backend, feature):
    """A sliding window, a mask or a bias lowers for CUDA without a CPU custom call on every
    backend that takes it ("auto" falls back to one); a backend that refuses it raises
    `BackendUnavailable` naming it when the program is lowered for CUDA."""
    dtype = jnp.bfloat16
    mesh = mesh_of(4)
    args = (
        S((2, 1, 8, 64), dtype),
        S((2, 2, 256, 64), dtype),
        S((2, 2, 256, 64), dtype),
        S((2, 1, 1, 256), jnp.bool_ if feature == "mask" else dtype),
    )

    def f(q, k, v, extra):
        kw: dict = {feature: extra} if feature != "window" else {"local_window_size": (63, 0)}
        if path == "dpa":  # jax's layout [batch, seq, heads, dim]
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            impl = None if backend == "auto" else backend
            return dot_product_attention(q, k, v, **kw, implementation=impl)
        common = dict(kv_layout="bhsd", backend=backend, causal=True, **kw)
        if path == "tree":
            return tree_decode(q, k, v, mesh=mesh, kv_axis="kv", **common)
        return flash_attention(q, k, v, q_offset=255, **common)[0]

    if backend in ("pallas", "cpu"):
        what = "local_window_size" if feature == "window" else feature
        match = "unavailable on cuda" if backend == "cpu" else what
        with pytest.raises(BackendUnavailable, match=match):
            lower(f, *args)
        return
    text = lower(f, *args)
    assert_cuda_program(text)
    assert "triton" not in text  # the Pallas kernel takes none of them: auto fell back


@cpu_only
@pytest.mark.parametrize("path", ["flash", "tree", "tree-pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_model_decode_step_lowers_for_cuda(path, dtype, monkeypatch):
    """A decode step of the Llama-style decoder (the shipped checkpoint is float32), on one
    device and with the cache sharded over a mesh. Equinox's runtime checks are host
    callbacks, which cannot be lowered for another platform: they give NaN here instead (its
    EQX_ON_ERROR=nan, read when a check is traced; the sizes are this test's own, so no other
    test reuses these traces)."""
    from treeattn.models import AttentionBackend, LlamaConfig, Transformer, decode_step

    monkeypatch.setattr(importlib.import_module("equinox._errors"), "EQX_ON_ERROR", "nan")

    mesh = mesh_of(2) if path.startswith("tree") else None
    name, _, kernel = path.partition("-")
    backend = AttentionBackend(
        name, kernel=kernel or "auto", mesh=mesh, kv_axis="kv" if mesh else None
    )
    config = LlamaConfig(
        vocab_size=72,
        hidden_size=384,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Transformer(config, backend=backend, dtype=dtype, key=jax.random.key(0))
    cache = model.init_cache(40, mesh=mesh, kv_axis="kv" if mesh else None)
    params, static = eqx.partition((model, cache), eqx.is_array)
    abstract = jax.tree.map(lambda x: S(x.shape, x.dtype), params)

    def step(params, token):
        model, cache = eqx.combine(params, static)
        return decode_step(model, token, cache)

    text = lower(step, abstract, S((), jnp.int32))
    assert_cuda_program(text)
    # One query per row: the Pallas decode kernel (the layers' attention calls are alike, so
    # the CUDA branch picks it for all) — also for a cache filled round-robin over the
    # devices, whose shards pass their fill lengths, not key positions.
    assert "triton" in text


@cpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_batched_model_decode_step_lowers_for_cuda(dtype, monkeypatch):
    """A vmapped decode step over rows of different cache lengths: each row's new token is
    written by the cache's own batching rule (a slice update per row, on the bits of a 16-bit
    cache), which must lower for CUDA as it does for the CPU."""
    from treeattn.models import LlamaConfig, Transformer, decode_step
    from treeattn.models._cache import empty_rows

    monkeypatch.setattr(importlib.import_module("equinox._errors"), "EQX_ON_ERROR", "nan")
    config = LlamaConfig(
        vocab_size=72,
        hidden_size=192,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Transformer(config, dtype=dtype, key=jax.random.key(0))
    cache = empty_rows(jax.eval_shape(lambda: model.init_cache(40)), 3)
    params, static = eqx.partition((model, cache), eqx.is_array)
    abstract = jax.tree.map(lambda x: S(x.shape, x.dtype), params)

    def step(params, tokens):
        model, cache = eqx.combine(params, static)
        return jax.vmap(lambda t, c: decode_step(model, t, c))(tokens, cache)

    text = lower(step, abstract, S((3,), jnp.int32))
    assert_cuda_program(text)
    assert "dynamic_update_slice" in text


@cpu_only
@pytest.mark.parametrize("devices_", [2, 4])
def test_model_tree_decode_step_lowers_to_cudnn(cudnn, devices_, monkeypatch):
    """The same with the kernel cuDNN (bf16; its version checks stubbed by the fixture): the
    tree decode step of a round-robin cache runs cuDNN's fused attention in every layer, with
    no portable-kernel fallback and no CPU custom call."""
    from treeattn.models import AttentionBackend, LlamaConfig, Transformer, decode_step

    monkeypatch.setattr(importlib.import_module("equinox._errors"), "EQX_ON_ERROR", "nan")
    mesh = mesh_of(devices_)
    backend = AttentionBackend("tree", kernel="cudnn", mesh=mesh, kv_axis="kv")
    config = LlamaConfig(
        vocab_size=72,
        hidden_size=256,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Transformer(config, backend=backend, dtype=jnp.bfloat16, key=jax.random.key(0))
    cache = model.init_cache(40, mesh=mesh, kv_axis="kv", block=4)
    params, static = eqx.partition((model, cache), eqx.is_array)
    abstract = jax.tree.map(lambda x: S(x.shape, x.dtype), params)

    def step(params, token):
        model, cache = eqx.combine(params, static)
        return decode_step(model, token, cache)

    text = lower(step, abstract, S((), jnp.int32))
    assert_cuda_program(text)
    assert re.search(r"custom_call @__cudnn\$fmha", text)


# ---------------------------------------------------------------------------------------------
# Eligibility: pure functions of the call, with the reason
# ---------------------------------------------------------------------------------------------


def dims_of(args):
    q, k, v, _ = args
    return check_decode(
        "t",
        jnp.zeros(q.shape, q.dtype),
        jnp.zeros(k.shape, k.dtype),
        jnp.zeros(v.shape, v.dtype),
        kv_layout="bhsd",
    )


def call(dims, dtype, platform, **kw):
    base = dict(
        causal=False, has_length=False, q_offset=0, has_positions=False, host="cpu", cuda=None
    )
    base.update(kw)
    return Call(dims=dims, dtype=jnp.dtype(dtype), platform=platform, **base)


def gpu(**kw):
    base = dict(
        cudnn=91000,
        cudnn_missing="",
        hopper=True,
        sm103=False,
        capability=(9, 0),
        flash_attn_jax=None,
    )
    base.update(kw)
    return CudaTarget(**base)


DIMS = check_decode(
    "t",
    jnp.zeros((1, 4, 8, 64)),
    jnp.zeros((1, 64, 2, 64)),
    jnp.zeros((1, 64, 2, 64)),
    kv_layout="bshd",
)
DIMS_ONE = check_decode(
    "t",
    jnp.zeros((1, 1, 8, 64)),
    jnp.zeros((1, 64, 2, 64)),
    jnp.zeros((1, 64, 2, 64)),
    kv_layout="bshd",
)
DIMS_DV = check_decode(
    "t",
    jnp.zeros((1, 4, 8, 64)),
    jnp.zeros((1, 64, 2, 64)),
    jnp.zeros((1, 64, 2, 32)),
    kv_layout="bshd",
)


@pytest.mark.parametrize(
    "platform, name, dtype, dims, kw, reason",
    [
        # ROCm is not CUDA: neither cuDNN nor flash-attn-jax nor the Triton kernel runs there.
        ("rocm", "cudnn", jnp.bfloat16, DIMS, {"cuda": gpu()}, "CUDA only"),
        ("rocm", "flash_attn_jax", jnp.bfloat16, DIMS, {"cuda": gpu()}, "CUDA kernel"),
        ("rocm", "pallas", jnp.bfloat16, DIMS, {}, "Triton for CUDA"),
        ("cuda", "cudnn", jnp.float32, DIMS, {"cuda": gpu()}, "float16/bfloat16 only"),
        (
            "cuda",
            "cudnn",
            jnp.bfloat16,
            DIMS,
            {"cuda": gpu(cudnn=None, cudnn_missing="cuDNN is not detected")},
            "cuDNN is not detected",
        ),
        ("cuda", "cudnn", jnp.bfloat16, DIMS_DV, {"cuda": gpu(hopper=False)}, "needs Hopper"),
        (
            "cuda",
            "cudnn",
            jnp.bfloat16,
            DIMS,
            {"cuda": gpu(sm103=True)},
            "10.3 needs cuDNN >= 9.11",
        ),
        ("cuda", "flash_attn_jax", jnp.bfloat16, DIMS_DV, {"cuda": gpu()}, "value dim must equal"),
        ("cuda", "flash_attn_jax", jnp.float32, DIMS, {"cuda": gpu()}, "float16/bfloat16 only"),
        ("cuda", "flash_attn_jax", jnp.bfloat16, DIMS, {"cuda": gpu(capability=(7, 5))}, "sm75"),
        ("cuda", "flash_attn_jax", jnp.bfloat16, DIMS, {"cuda": gpu(capability=(10, 0))}, "sm100"),
        (
            "cuda",
            "flash_attn_jax",
            jnp.bfloat16,
            DIMS,
            {"cuda": gpu(capability=None)},
            "compute capability cannot be read",
        ),
        (
            "cuda",
            "flash_attn_jax",
            jnp.bfloat16,
            DIMS,
            {"cuda": gpu(flash_attn_jax="requires jax<0.9")},
            "jax<0.9",
        ),
        (
            "cuda",
            "flash_attn_jax",
            jnp.bfloat16,
            DIMS,
            {"has_length": True, "cuda": gpu()},
            "partly filled",
        ),
        ("cuda", "cpu", jnp.float32, DIMS, {}, "XLA:CPU FFI"),
        ("cuda", "pallas", jnp.float64, DIMS_ONE, {}, "float16/bfloat16/float32"),
    ],
)
def test_eligibility_says_why(platform, name, dtype, dims, kw, reason):
    assert reason in (KERNELS[name].why_not(call(dims, dtype, platform, **kw)) or "")


def test_eligible_on_a_described_gpu():
    """The same records say yes for a GPU that can run them."""
    assert KERNELS["cudnn"].why_not(call(DIMS, jnp.bfloat16, "cuda", cuda=gpu())) is None
    assert KERNELS["cudnn"].why_not(call(DIMS_DV, jnp.bfloat16, "cuda", cuda=gpu())) is None
    assert (
        KERNELS["flash_attn_jax"].why_not(
            call(DIMS, jnp.bfloat16, "cuda", cuda=gpu(capability=(8, 6)))
        )
        is None
    )
    assert KERNELS["pallas"].why_not(call(DIMS_ONE, jnp.float32, "cuda")) is None


def test_lengths_are_clipped_at_zero():
    """A shard past the fill point has length 0 and, causal, a negative offset: every kernel
    that masks by length sees 0, never a negative length."""
    dims = check_decode(
        "t",
        jnp.zeros((3, 1, 4, 8)),
        jnp.zeros((3, 16, 2, 8)),
        jnp.zeros((3, 16, 2, 8)),
        kv_layout="bshd",
    )
    got = visible_lengths(jnp.array([0, 5, 16]), jnp.array([-7, -1, 3]), causal=True, dims=dims)
    np.testing.assert_array_equal(got, [0, 0, 4])


# ---------------------------------------------------------------------------------------------
# The Pallas kernel, interpreted here: padded head dims, dv != qk, empty shards
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk, dv", [(80, 80), (96, 96), (64, 32), (24, 40)])
def test_pallas_pads_head_dims(qk, dv, getkey):
    q = jax.random.normal(getkey(), (2, 1, 4, qk))
    k = jax.random.normal(getkey(), (2, 300, 2, qk))
    v = jax.random.normal(getkey(), (2, 300, 2, dv))
    n = np.array([300, 123])
    out, lse = flash_attention(q, k, v, kv_length=n, causal=True, q_offset=n - 1, backend="pallas")
    check_out_lse(out, lse, *ref.decode(q, k, v, n, causal=True, q_offset=n - 1), jnp.float32)


def test_empty_shards_give_zero_and_minus_inf(getkey):
    """Shards past the fill point: Pallas' own normalisation would give 0/0."""
    q, k, v = make_decode_qkv(getkey, 2, 1, 4, 2, 64, 16)
    # A shard past the fill point, as tree decoding sees it: traced length 0, offset < 0.
    for backend in ("pallas", "xla", "reference", "cpu"):
        f = functools.partial(flash_attention, causal=True, backend=backend)
        n, off = jnp.array([0, 0]), jnp.array([-5, -1])
        out, lse = jax.jit(lambda *a, f=f: f(*a[:3], kv_length=a[3], q_offset=a[4]))(
            q, k, v, n, off
        )
        np.testing.assert_array_equal(out, 0.0)
        assert np.all(np.isneginf(lse))
    mesh = mesh_of(4)
    k = jnp.where(jnp.arange(64)[None, :, None, None] >= 10, jnp.nan, k)  # unfilled slots: NaN
    out = tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_length=10, backend="pallas")
    assert ref.rel_err(out, ref.decode(q, k[:, :10], v[:, :10], 10)[0]) <= TOL[jnp.float32]


@cpu_only
def test_pallas_float32_runs_at_full_precision():
    """Triton's dots default to TF32 (~1e-3 relative) for float32: the CUDA branch of a
    float32 call is traced at HIGHEST precision, which its lowering maps to IEEE."""
    args = (
        S((2, 1, 8, 64), jnp.float32),
        S((2, 2, 256, 64), jnp.float32),
        S((2, 2, 256, 64), jnp.float32),
        S((2,), jnp.int32),
    )
    jaxpr = str(
        jax.make_jaxpr(
            lambda q, k, v, n: flash_attention(
                q, k, v, kv_length=n, kv_layout="bhsd", backend="pallas"
            )
        )(*args)
    )
    assert "precision=(Precision.HIGHEST, Precision.HIGHEST)" in jaxpr


# ---------------------------------------------------------------------------------------------
# On a CUDA host only (make test-gpu): the kernels themselves against float64 NumPy
# ---------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("backend", ["auto", "pallas", "cudnn", "flash_attn_jax", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qk, dv", [(64, 64), (80, 80), (128, 128), (128, 64)])
@pytest.mark.parametrize("q_seq, length", [(1, True), (1, False), (16, False)])
def test_gpu_kernels_match_numpy(backend, dtype, qk, dv, q_seq, length, getkey):
    b, h, kh, kv = 2, 8, 2, 512
    q = jax.random.normal(getkey(), (b, q_seq, h, qk), dtype)
    k = jax.random.normal(getkey(), (b, kv, kh, qk), dtype)
    v = jax.random.normal(getkey(), (b, kv, kh, dv), dtype)
    n = np.array([kv, 200]) if length else np.array([kv, kv])
    kw = dict(causal=True, q_offset=kv - q_seq) if not length else dict(causal=True, q_offset=n - 1)
    dims = check_decode("t", q, k, v, kv_layout="bshd")
    try:
        select_backend(
            backend,
            dims,
            dtype,
            has_length=length,
            **{**kw, "q_offset": kw["q_offset"] if isinstance(kw["q_offset"], int) else None},
        )
    except BackendUnavailable:
        pytest.skip(f"{backend} cannot serve this call here")
    out, lse = flash_attention(q, k, v, kv_length=n if length else None, backend=backend, **kw)
    exp_out, exp_lse = ref.decode(
        np.asarray(q, np.float64),
        np.asarray(k, np.float64),
        np.asarray(v, np.float64),
        n,
        causal=True,
        q_offset=kw["q_offset"],
    )
    assert ref.rel_err(out, exp_out) <= TOL[dtype]
    assert lse.dtype == jnp.float32
    finite = np.isfinite(exp_lse)
    # The lse is float32-accurate whatever the input dtype (cuDNN's statistics are read as
    # float32); bfloat16 inputs carry their own rounding into the logits.
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(lse)[finite], exp_lse[finite], rtol=tol, atol=tol)


@cuda_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_tree_decode_matches_numpy(dtype, getkey):
    p = len(jax.devices())
    mesh = mesh_of(p)
    q, k, v = make_decode_qkv(getkey, 2, 1, 8, 2, 256 * p, 64, dtype=dtype)
    n = np.array([256 * p, 100])
    out = tree_decode(q, k, v, mesh=mesh, kv_axis="kv", kv_length=n)
    exp = ref.decode(*(np.asarray(x, np.float64) for x in (q, k, v)), n)[0]
    assert ref.rel_err(out, exp) <= TOL[dtype]


@cpu_only
def test_few_float32_rows_lower_for_cuda_as_one_plain_product():
    """The forms of a few float32 rows on XLA:CPU (treeattn's C++ product, or `w @ x.T` behind
    barriers without it) are the CPU's alone: for CUDA the model's product lowers as the one
    `x @ w.T`, with no CPU custom call, barrier or transpose."""
    from treeattn.models import matmul

    x, w = S((8, 64), jnp.float32), S((128, 64), jnp.float32)
    cpu, cuda = lower(matmul, x, w, platform="cpu"), lower(matmul, x, w)
    assert "treeattn_cpu_matmul" in cpu or "optimization_barrier" in cpu  # sees the CPU form
    assert_cuda_program(cuda)
    assert "treeattn_cpu_matmul" not in cuda
    assert "optimization_barrier" not in cuda and "transpose" not in cuda
    assert re.findall(r"dot_general.*-> tensor<([\dx]+)xf32>", cuda) == ["8x128"]


@cpu_only
def test_masking_rules_lower_for_cuda():
    """Segment ids, a prefix and a mask function run on the energy kernel (plain JAX): a batched
    call, the blockwise gradient with its skipped tiles (also vmapped over rows of different
    documents), the blockwise diagnostics in chunks of queries, and tree decoding over 4
    devices lower for CUDA with no CPU custom call."""
    from treeattn.energy import attention_entropy, energy_attention

    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)
    rules = dict(
        q_segment_ids=seg, kv_segment_ids=seg, prefix_length=3, mask_mod=lambda b, h, i, j: j != 5
    )
    q, k = S((2, 64, 4, 16), jnp.float32), S((2, 64, 2, 16), jnp.float32)
    assert_cuda_program(lower(lambda q, k: flash_attention(q, k, k, causal=True, **rules)[0], q, k))

    def grad(q, k):
        return jax.grad(
            lambda q: energy_attention(q, k, k, causal=True, **rules, block_size=16).sum()
        )(q)

    assert_cuda_program(lower(grad, S((64, 4, 16), jnp.float32), S((64, 2, 16), jnp.float32)))

    # Rows of different documents under vmap (the batch's tile bounds, a custom batching rule),
    # and the diagnostics' blockwise F in four chunks of 1,024 queries.
    def grad_of_row(q, k, seg):
        kw = {**rules, "q_segment_ids": seg, "kv_segment_ids": seg}
        return jax.grad(
            lambda q: energy_attention(q, k, k, causal=True, **kw, block_size=16).sum()
        )(q)

    rows = S((2, 64, 4, 16), jnp.float32), S((2, 64, 2, 16), jnp.float32), S((2, 64), jnp.int32)
    assert_cuda_program(lower(jax.vmap(grad_of_row), *rows))
    long_seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 1024)

    def entropy(q, k):
        kw = {"q_segment_ids": long_seg, "kv_segment_ids": long_seg}
        return attention_entropy(q, k, k, causal=True, **kw, block_size=256)

    long = S((4096, 4, 16), jnp.float32), S((4096, 2, 16), jnp.float32)
    assert_cuda_program(lower(entropy, *long))
    mesh = mesh_of(4)
    tree = lambda q, k: tree_decode(q, k, k, mesh=mesh, kv_axis="kv", causal=True, **rules)  # noqa: E731
    assert_cuda_program(lower(tree, q, k))


def test_softpick_and_cosformer_lower_for_cuda():
    """Softpick's lift at zeta = 0 (attention and training through it, blockwise) and
    cosFormer (attention over keys, and a causal chunk and a query against its linear state at
    the tokens' positions) lower for CUDA with no CPU custom call."""
    from treeattn.energy import CosFormer, LinearState, Softpick, energy_attention

    q, k = S((256, 4, 16), jnp.float32), S((256, 2, 16), jnp.float32)
    for energy in (Softpick(), CosFormer(512)):

        def grad(q, k, energy=energy):
            def loss(q):
                out = energy_attention(q, k, k, causal=True, energy=energy, block_size=64)
                return jnp.sum(out**2)

            return jax.grad(loss)(q)

        assert_cuda_program(lower(grad, q, k))
        assert_cuda_program(
            lower(lambda q, k, e=energy: energy_attention(q, k, k, causal=True, energy=e), q, k)
        )

    def decode(q, k):
        at = jnp.arange(256, dtype=jnp.int32)
        empty = LinearState.empty(2, 16, 16, energy=CosFormer(512))
        out, state = empty.attend_causal(q, k, k, positions=at)
        return out, state.attend(q[-1:], positions=at[-1:] + 1)

    assert_cuda_program(lower(decode, q, k))
