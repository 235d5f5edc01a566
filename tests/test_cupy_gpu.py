"""The CuPy backend on a real device: the same battery as under the emulator.

Marked `gpu`; skipped cleanly where CuPy or a CUDA device is missing (this
machine and CI). Run on a GPU with `python -m pytest -m gpu`.
"""

import numpy as np
import pytest

import flashcupy
from conftest import BF16, CASES, DTYPES, LAYOUTS, assert_matches_oracle, bf16_bits, case_id, make_qkv
from modifier_checks import named_modifiers
from flashcupy import backends
from flashcupy._problem import MODIFIERS

REASON = backends.unavailable_reason("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no GPU for cupy: {REASON}")]


def on_device(*arrays):
    import cupy
    return [cupy.asarray(a) for a in arrays]


def check(q, k, v, dtype, causal, rng):
    import cupy
    dout = rng.standard_normal(q.shape).astype(dtype)
    dq_, dk_, dv_, ddout = on_device(q, k, v, dout)
    out, lse = flashcupy.attention(dq_, dk_, dv_, causal=causal, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype and out.shape == q.shape
    # with a gradient of lse too (as the emulated contract suite): NaN in the rows that see no key
    dlse = np.where(np.isneginf(lse.get()), np.nan, rng.standard_normal(lse.shape)).astype(lse.dtype)
    grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=causal, dlse=cupy.asarray(dlse))
    assert all(isinstance(g, cupy.ndarray) for g in grads)
    assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, causal=causal, backend="cupy",
                          dlse=dlse)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_battery(rng, case, dtype):
    B, Sq, Sk, Hq, Hkv, D, causal = case
    check(*make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype), dtype, causal, rng)


def device_view(x, layout):
    """x on the device, as a view with the same kind of strides as conftest.strided_empty gives."""
    import cupy
    B, S, H, D = x.shape
    if layout == "bshd":
        return cupy.asarray(x)
    if layout == "bhsd":
        return cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    if layout == "sliced":
        big = cupy.zeros((B, 2 * S, H, 2 * D), x.dtype)
        big[:, ::2, :, ::2] = cupy.asarray(x)
        return big[:, ::2, :, ::2]
    return cupy.asarray(np.ascontiguousarray(x[:, ::-1]))[:, ::-1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_views(rng, layout):
    q, k, v = make_qkv(rng, 2, 70, 90, 4, 2, 64, np.float16, layout=layout)
    out = flashcupy.attention(*(device_view(x, layout) for x in (q, k, v)), causal=True)
    assert_matches_oracle((out.get(),), q, k, v, causal=True, backend="cupy")


def test_runs_on_the_current_stream(rng):
    import cupy
    q, k, v = make_qkv(rng, 1, 300, 300, 2, 2, 64, np.float32)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        out = flashcupy.attention(*on_device(q, k, v))
        stream.synchronize()
    assert_matches_oracle((out.get(),), q, k, v, backend="cupy")


def test_long_sequence_has_no_nan(rng):
    q, k, v = make_qkv(rng, 1, 4096, 4096, 1, 1, 128, np.float16)
    out = flashcupy.attention(*on_device(q, k, v), causal=True)
    assert_matches_oracle((out.get(),), q, k, v, causal=True, backend="cupy")


def device_problem(rng, case, fmt):
    """q, k, v, dout of a random problem (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) in fmt
    (float16 or bfloat16), on the host (as float16 or ml_dtypes' bfloat16) and on the device (bfloat16 as
    its bits), and the calls' dtype keyword."""
    import cupy
    value = np.float16 if fmt == "float16" else BF16
    q, k, v = make_qkv(rng, *case, value)
    dout = rng.standard_normal(q.shape).astype(value)
    bits = (lambda x: x) if fmt == "float16" else bf16_bits
    return (q, k, v, dout), tuple(cupy.asarray(bits(x)) for x in (q, k, v, dout)), (None if fmt == "float16"
                                                                                    else "bfloat16")


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [(2, 300, 257, 4, 2, 128, True), (1, 200, 333, 2, 2, 64, False),
                                  (1, 333, 200, 2, 1, 40, True)], ids=case_id)
def test_tensor_core_backward(rng, case, fmt):
    """Many query and key blocks through the tensor-core backward kernels (flash_bwd_tc.cu; on compute
    capability 9.0 the Hopper one, flash_bwd_sm90.cu), then deterministic (flash_bwd_tc.cu's kernels; on 9.0
    flash_bwd_sm90.cu's dQ added in key-block order): twice, the same bits."""
    import cupy
    from flashcupy.backends import cupy_backend
    *shape, causal = case
    (q, k, v, dout), (dq_, dk_, dv_, ddout), dtype = device_problem(rng, shape, fmt)
    out, lse = flashcupy.attention(dq_, dk_, dv_, causal=causal, return_lse=True, dtype=dtype)
    p = flashcupy._checks.problem(dq_, dk_, dv_, causal, None, dtype)
    hopper = cupy.cuda.Device().compute_capability == "90"
    assert cupy_backend.backward_path(p, ddout, dq_, dk_, dv_, out) == ("hopper" if hopper else "tensor-core")
    for deterministic in (False, True):
        grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=causal, dtype=dtype,
                                             deterministic=deterministic)
        assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, causal=causal, backend="cupy")
    again = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=causal, dtype=dtype, deterministic=True)
    for a, b in zip(grads, again):
        np.testing.assert_array_equal(a.get(), b.get())


def test_packed_batch_keeps_each_sequence_to_itself(rng):
    # attention_varlen and its backward on the device (the backward on the Hopper kernels on an H100/H200,
    # whose boxes reach into the next sequence's rows), each sequence against the oracle; NaN in every
    # row of the second sequence stays there
    from varlen_checks import packed_inputs
    lengths_q, lengths_k = [70, 30, 0, 200, 1], [150, 20, 5, 260, 3]
    q, k, v, cu_q, cu_k = packed_inputs(rng, lengths_q, lengths_k, 4, 2, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    q[70:100, 0, 0], v[150:170, 1, :] = np.nan, np.nan
    dq_, dk_, dv_, ddout, dcu_q, dcu_k = on_device(q, k, v, dout, cu_q, cu_k)
    out, lse = flashcupy.attention_varlen(dq_, dk_, dv_, dcu_q, dcu_k, causal=True, return_lse=True)
    grads = flashcupy.attention_varlen_backward(ddout, dq_, dk_, dv_, out, lse, dcu_q, dcu_k, causal=True)
    # deterministic: the same bits twice (on an H100/H200 the packed slots' key blocks add in turn)
    ordered = [flashcupy.attention_varlen_backward(ddout, dq_, dk_, dv_, out, lse, dcu_q, dcu_k, causal=True,
                                                   deterministic=True) for _ in range(2)]
    for a, b in zip(*ordered):
        np.testing.assert_array_equal(a.get(), b.get())
    out, lse, dq, dk, dv = (x.get() for x in (out, lse, *grads))
    for b in (0, 3, 4):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_matches_oracle((out[None, sq], lse[None, :, sq], dq[None, sq], dk[None, sk], dv[None, sk]),
                              q[None, sq], k[None, sk], v[None, sk], dout[None, sq], causal=True, backend="cupy")


def test_a_value_head_dim_of_its_own(rng):
    # MLA's head dims (192 for q and k, 128 for v) on the device, their tiles padded to 192 (256 in the
    # Hopper backward), against the oracle, dQ by atomics (Hopper: bulk reduce-adds) and deterministic:
    # with a bias (dbias from flash_pairs.cu) the mma.sync forward (the Hopper one takes no bias above head
    # dim 128) and, on an sm_90, the Hopper backward (its 256 kernel: V's and dO's fourth atoms zeroed,
    # never loaded), elsewhere the mma.sync one (two column parts, v's second partly past its head dim);
    # without it, on an sm_90, the Hopper forward too (V_j's third atom a box wholly past v's head dim,
    # which lands as the copy engine's zeros)
    import cupy
    from flashcupy import _checks
    from flashcupy.backends import cupy_backend
    hopper = cupy.cuda.Device().compute_capability == "90"
    q, k, v = make_qkv(rng, 2, 200, 260, 4, 2, 192, np.float16, head_dim_v=128)
    dout = rng.standard_normal((2, 200, 4, 128)).astype(np.float16)
    bias = rng.standard_normal((1, 4, 200, 260)).astype(np.float16)
    dq_, dk_, dv_, ddout, dbias_ = on_device(q, k, v, dout, bias)
    for b, b_ in ((bias, dbias_), (None, None)):
        p = _checks.problem(dq_, dk_, dv_, True, None, None, "cupy", bias=b_)
        assert cupy_backend.forward_path(p, dq_, dk_, dv_) == ("hopper" if hopper and b is None else "tensor-core")
        assert cupy_backend.backward_path(p, ddout, dq_, dk_, dv_, ddout) == ("hopper" if hopper else "tensor-core")
        out, lse = flashcupy.attention(dq_, dk_, dv_, causal=True, bias=b_, return_lse=True)
        for deterministic in (False, True):
            grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=True, bias=b_,
                                                 deterministic=deterministic)
            assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, causal=True, bias=b,
                                  backend="cupy")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dropout_on_the_device(rng, dtype):
    # dropout's keep mask drawn by the device's own __umulhi (float16: the Hopper kernels on an sm_90, else
    # the mma.sync ones; float32: the SIMT ones), with a bias broadcast over rows (dbias from
    # flash_pairs.cu on SIMT), and the seed read from device memory (flashcupy.jax's way), against the
    # oracle's Philox
    import cupy
    from flashcupy import _api
    q, k, v = make_qkv(rng, 2, 200, 260, 4, 2, 64, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    bias = rng.standard_normal((2, 4, 1, 260)).astype(dtype)
    seed = 2**40 + 12345
    drop = dict(causal=True, dropout_p=0.2, dropout_seed=seed)
    dq_, dk_, dv_, ddout, dbias_ = on_device(q, k, v, dout, bias)
    out, lse = flashcupy.attention(dq_, dk_, dv_, bias=dbias_, return_lse=True, **drop)
    grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, bias=dbias_, **drop)
    assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, bias=bias, backend="cupy", **drop)
    words = cupy.asarray(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32))
    out2, _ = _api.forward(dq_, dk_, dv_, bias=dbias_, causal=True, dropout_p=0.2, dropout_seed=0,
                           dropout_seed_words=words)
    np.testing.assert_array_equal(out2.get(), out.get())


def test_dask_with_cupy_chunks_and_a_pair_bias(rng):
    # flashcupy.dask with CuPy chunks (each pair on the cupy backend), a pair bias shared by the batch
    # as a dask array of CuPy blocks, a key-padding mask as a CuPy array, and dbias; against the oracle
    # (dask travels as wheels: benchmarks/gpu_wheels.sh)
    import cupy
    da = pytest.importorskip("dask.array", reason="flashcupy.dask needs Dask (benchmarks/gpu_wheels.sh carries it)")
    import dask
    import flashcupy.dask as fdask
    q, k, v = make_qkv(rng, 2, 300, 260, 4, 2, 64, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    bias = rng.standard_normal((1, 4, 300, 260)).astype(np.float16)
    mask = rng.random((2, 1, 1, 260)) < 0.9
    mask[1, ..., 200:] = False  # the second batch element's last key chunk hidden from every row
    Q = da.from_array(cupy.asarray(q), chunks=(1, 128, 2, -1))
    K, V = (da.from_array(cupy.asarray(x), chunks=(1, 100, 1, -1)) for x in (k, v))
    Bias = da.from_array(cupy.asarray(bias), chunks=(1, 2, 150, 130))
    out, vjp = fdask.attention_vjp(Q, K, V, causal=True, bias=Bias, mask=cupy.asarray(mask), deterministic=True)
    lse = fdask.attention(Q, K, V, causal=True, bias=Bias, mask=cupy.asarray(mask), return_lse=True)[1]
    grads = vjp(da.from_array(cupy.asarray(dout), chunks=Q.chunks))
    got = dask.compute(out, lse, *grads, scheduler="threads")
    assert all(isinstance(x, cupy.ndarray) for x in got)
    assert_matches_oracle([x.get() for x in got], q, k, v, dout, causal=True, bias=bias, mask=mask, backend=None)
    for a, b in zip(got[2:], dask.compute(*grads, scheduler="threads")):  # deterministic: the same bits again
        np.testing.assert_array_equal(a.get(), b.get())


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("switch, case", [
    ("SM90_WIDE", (1, 300, 500, 2, 1, 128, False)), ("SM90_WIDE", (1, 200, 450, 2, 2, 64, False)),
    ("SM90_TALL_FORWARD", (1, 400, 333, 2, 1, 64, True)), ("SM90_TALL_FORWARD", (2, 200, 300, 2, 2, 40, False)),
    ("SM90_TALL_BACKWARD", (1, 300, 260, 2, 1, 64, True)), ("SM90_PERSISTENT", (2, 500, 333, 4, 2, 128, True)),
], ids=lambda x: x if isinstance(x, str) else case_id(x))
def test_the_hopper_tiles_off_by_default_match_the_oracle(rng, monkeypatch, switch, case, fmt):
    """The Hopper kernels' options that no GPU has timed yet (cupy_backend's switches, off by default: FA3's
    wider key blocks, its 192-row forward at head_dim 64 with three consumer warpgroups, its 128-row backward
    pass, the persistent forward), on silicon against the oracle, as the emulator runs them: whether the
    emulator's model of them holds on the hardware (a setmaxnreg beyond the CTA's registers would hang)."""
    import cupy
    from flashcupy.backends import cupy_backend
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    monkeypatch.setattr(cupy_backend, switch, True)
    *shape, causal = case
    (q, k, v, dout), (dq_, dk_, dv_, ddout), dtype = device_problem(rng, shape, fmt)
    out, lse = flashcupy.attention(dq_, dk_, dv_, causal=causal, return_lse=True, dtype=dtype)
    grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=causal, dtype=dtype)
    assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, causal=causal, backend="cupy")


def _hopper_forward(rng, case, modifiers, fmt):
    """The forward of a random problem (case: shape and causal) with `modifiers` (named_modifiers') on the
    device, skipped but on compute capability 9.0: (q, k, v, dout) on the host, the same on the device,
    the calls' keywords (dtype, causal, the modifiers on the device), the host's modifiers, out, lse."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper kernels run on compute capability 9.0 only")
    *shape, causal = case
    B, Sq, Sk, Hq = shape[:4]
    host, device, dtype = device_problem(rng, shape, fmt)
    kw = named_modifiers(rng, modifiers, B, Sq, Sk, Hq, window=(90, 7))
    call = dict(dtype=dtype, causal=causal, **{m: cupy.asarray(x) if isinstance(x, np.ndarray) else x
                                               for m, x in kw.items()})
    out, lse = flashcupy.attention(*device[:3], return_lse=True, **call)
    return host, device, call, kw, out, lse


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_turing_kernels_on_this_gpu(rng, monkeypatch, head_dim):
    """The float16 tensor-core kernels as a Turing GPU (sm_75) runs them: Turing's tiles (the runtime says
    compute capability 7.5) and tensor_core.cuh's stand-ins (two m16n8k8 an mma, plain copies), built on
    this GPU's own arch with -DAMPERE_ARCH=1000 as tests/test_tensor_core_gpu.py builds its blocks; the
    forward, both backwards and a split decode against the oracle. Their speed here says nothing of a T4's."""
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import runtime, sources
    turing = runtime.cupy_runtime()
    turing.compute_capability = lambda x: 75
    monkeypatch.setattr(cupy_backend, "runtime", turing)
    monkeypatch.setattr(sources, "COMPILE_OPTIONS", sources.COMPILE_OPTIONS + ("-DAMPERE_ARCH=1000",))
    (q, k, v, dout), (dq_, dk_, dv_, ddout), _ = device_problem(rng, (1, 300, 333, 4, 2, head_dim - 8), "float16")
    p = flashcupy._checks.problem(dq_, dk_, dv_, True, None, None)
    assert cupy_backend.forward_path(p, dq_, dk_, dv_) == "tensor-core"
    assert cupy_backend.backward_path(p, ddout, dq_, dk_, dv_, dq_) == "tensor-core"
    out, lse = flashcupy.attention(dq_, dk_, dv_, causal=True, return_lse=True)
    for deterministic in (False, True):
        grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, causal=True, deterministic=deterministic)
        assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout, causal=True, backend="cupy")
    decode = flashcupy.attention_with_kvcache(dq_[:, :1], dk_, dv_, num_splits=3, return_lse=True)
    assert_matches_oracle([x.get() for x in decode], q[:, :1], k, v, backend="cupy")


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("case, modifiers", [
    ((1, 300, 500, 2, 1, 256, True), ()), ((2, 200, 333, 2, 2, 160, False), ()), ((1, 130, 90, 1, 1, 200, False), ()),
    ((1, 300, 400, 2, 1, 128, True), ("softcap", "alibi", "bias", "mask", "window")),
    ((1, 200, 250, 2, 2, 256, False), ("softcap", "mask")),
], ids=lambda x: "+".join(x) or "plain" if not x or isinstance(x[0], str) else case_id(x))
def test_the_hopper_forwards_new_cases_match_the_oracle(rng, case, modifiers, fmt):
    """head_dim 136..256 (FA3's 128 x 80 tile, O_s in Q_s at 256; wgmma N = 80 and 256) and the score
    modifiers and bool mask (64-key blocks with a bias or mask) on the Hopper forward, on silicon against
    the oracle (the backward: test_the_hopper_backward_with_modifiers_matches_the_oracle)."""
    (q, k, v, _), _, call, kw, out, lse = _hopper_forward(rng, case, modifiers, fmt)
    assert_matches_oracle([x.get() for x in (out, lse)], q, k, v, causal=case[-1], backend="cupy", **kw)


@pytest.mark.parametrize("case, modifiers, fmt", [
    ((1, 300, 400, 2, 1, 64, True), ("softcap", "alibi", "bias", "mask", "window"), "float16"),
    ((2, 200, 333, 2, 2, 128, False), ("softcap", "alibi", "bias", "mask"), "bfloat16"),
    ((1, 333, 150, 2, 1, 96, True), ("softcap",), "float16"),  # rows before 183 see no key, NaN in their dout
    ((1, 333, 150, 2, 1, 256, True), ("softcap", "mask"), "bfloat16"),  # SPLIT_D (head_dim 256), the same rows
    ((2, 200, 333, 2, 1, 160, False), ("softcap",), "float16"),  # SPLIT_D at 160: three atoms loaded, one zeroed
], ids=lambda x: x if isinstance(x, str) else "+".join(x) if x and isinstance(x[0], str) else case_id(x))
def test_the_hopper_backward_with_modifiers_matches_the_oracle(rng, case, modifiers, fmt):
    """The score modifiers and the bool mask on the Hopper backward (specs.SM90_BACKWARD_MODS), and rows that
    see no key inside its passes (their dO_i rows zeroed in shared memory: dead_rows), on silicon against the
    oracle, deterministic or not (five cases: each compiles its own kernels, in the session's pytest stage)."""
    import cupy
    from flashcupy.backends import cupy_backend
    (q, k, v, dout), (dq_, dk_, dv_, ddout), call, kw, out, lse = _hopper_forward(rng, case, modifiers, fmt)
    dead = ~np.isfinite(lse.get()).transpose(0, 2, 1)
    ddout[cupy.asarray(dead)] = np.nan if fmt == "float16" else 0x7FC0  # bfloat16's NaN, as its bits
    p = flashcupy._checks.problem(dq_, dk_, dv_, call["causal"], None, call["dtype"],
                                  **{m: call.get(m) for m in MODIFIERS})
    assert cupy_backend.backward_path(p, ddout, dq_, dk_, dv_, out) == "hopper"
    for deterministic in (False, True):
        grads = flashcupy.attention_backward(ddout, dq_, dk_, dv_, out, lse, deterministic=deterministic, **call)
        got = [x.get() for x in (out, lse, *grads)]
        assert not any(np.isnan(g).any() for g in got[2:])
        assert_matches_oracle(got, q, k, v, dout, causal=case[-1], backend="cupy", **kw)


@pytest.mark.parametrize("case, modifiers", [
    ((1, 300, 500, 2, 1, 256, True), ()),
    ((2, 200, 333, 2, 2, 200, False), ("softcap", "alibi", "bias", "mask", "window")),
    ((1, 150, 260, 4, 2, 176, True), ("softcap", "alibi", "bias", "window")),
], ids=lambda x: "+".join(x) or "plain" if not x or isinstance(x[0], str) else case_id(x))
def test_the_mma_sync_kernels_above_head_dim_128_match_the_oracle(rng, monkeypatch, case, modifiers):
    """The mma.sync forward at head_dim 136..256 (Q_i from shared memory at every pass, 64 x 16 at 256), on
    any sm_80+ device (on an H100/H200 with USE_WGMMA off), and the mma.sync backward there (two CTAs a block,
    specs.tc_column_parts; where the device lets a CTA have its shared memory: not at 256 on an sm_86, sm_89,
    sm_120), by default and deterministic, against the oracle."""
    import cupy
    from flashcupy.backends import cupy_backend
    from flashcupy.backends.cupy_backend import specs
    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("the mma.sync kernels above head_dim 128 need sm_80")
    monkeypatch.setattr(cupy_backend, "USE_WGMMA", False)
    *shape, causal = case
    (q, k, v, _), (dq_, dk_, dv_, _), _ = device_problem(rng, shape, "float16")
    kw = named_modifiers(rng, modifiers, *shape[:4], window=(90, 7))
    on_gpu = {m: cupy.asarray(x) if isinstance(x, np.ndarray) else x for m, x in kw.items()}
    p = flashcupy._checks.problem(dq_, dk_, dv_, causal, None, None, **{m: on_gpu.get(m) for m in MODIFIERS})
    assert cupy_backend.forward_path(p, dq_, dk_, dv_) == "tensor-core"
    out, lse = flashcupy.attention(dq_, dk_, dv_, causal=causal, return_lse=True, **on_gpu)
    assert_matches_oracle([x.get() for x in (out, lse)], q, k, v, causal=causal, backend="cupy", **kw)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float16))
    optin = int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    # (the mask at 256 stays SIMT: specs.TC_BACKWARD_MASK_BUCKETS)
    eligible = specs.tensor_core_eligible("float16", shape[5], cupy_backend._mods(p), backward=True)
    for deterministic in (False, True):
        module = specs.tc_backward_module("float16", shape[5], cupy_backend._mods(p), deterministic)
        fits = max(kernel.dynamic_smem for kernel in module.kernels) <= optin
        assert cupy_backend.backward_path(p, dout, dq_, dk_, dv_, out, deterministic) == (
            "tensor-core" if eligible and fits else "simt")
        grads = flashcupy.attention_backward(dout, dq_, dk_, dv_, out, lse, causal=causal,
                                             deterministic=deterministic, **on_gpu)
        assert_matches_oracle([x.get() for x in (out, lse, *grads)], q, k, v, dout.get(), causal=causal,
                              backend="cupy", **kw)
