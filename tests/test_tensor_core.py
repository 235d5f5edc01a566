"""Tensor-core building blocks (kernels/tensor_core.cuh) under the CPU emulator, and under NVRTC.

The emulator implements each PTX instruction of tensor_core.cuh as the PTX ISA defines it
(tests/emulator/include/emu_tensor_core.h). These tests check it against the ISA's fragment
layouts computed here in NumPy, independently: mma's A, B and C/D layouts element by element,
every ldmatrix variant, and the whole cp.async -> ldmatrix -> mma pipeline against NumPy's
matmul; and that a missing cp.async wait gives a wrong answer, as on a GPU. The NVRTC tests
compile the same kernels for sm_80 and sm_90 and look for the tensor-core instructions in the
SASS (nvdisasm, from the nvidia-cuda-nvdisasm wheel).

Then the tensor-core forward (attn_fwd_tc.cu) and backward (attn_bwd_tc.cu) kernels, through the
cupy backend's dispatch under the emulator, against the float64 oracle; each of their barriers and
cp.async waits removed in turn gives a wrong answer; and they compile to HMMA without spills.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from conftest import assert_close, make_qkv, reference
from cupy_emulation import compile_module, emulated
from emulator import CP_ASYNC_MODES, EmulatedModule, KernelError, garbage

import flashcupy
from flashcupy.backends import cupy_backend
from flashcupy.backends.cupy_backend import nvrtc, sources, specs

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_KERNELS = os.path.join(HERE, "emulator", "testkernels", "tensor_core.cu")
INCLUDE = f"-I{sources.KERNEL_DIR}"
ORDERS = ("ascending", "descending")
ARCHS = ("sm_80", "sm_90")
NARROW = ("float16", "bfloat16")
CUDA_NAME = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
LDMATRIX = [(num, trans) for num in (1, 2, 4) for trans in (False, True)]


def source():
    with open(TEST_KERNELS) as f:
        return f.read()


NAMES = ([f"mma_fragments<{t}>" for t in CUDA_NAME.values()]
         + [f"ldmatrix_variant<{num}, {str(trans).lower()}>" for num, trans in LDMATRIX]
         + [f"tile_matmul<{t}>" for t in CUDA_NAME.values()]
         + ["pack_and_exp", "tensor_core_misuse"])

_modules = {}


def kernel(name, order="ascending"):
    if order not in _modules:
        _modules[order] = EmulatedModule(source(), NAMES, (INCLUDE,), thread_order=order)
    return _modules[order].get_function(name)


# ----------------------------------------------------------------------------
# 16-bit formats and the ISA's fragment layouts, in NumPy


def to_bits(x, fmt):
    """uint16 patterns of float32 `x` rounded to `fmt` (nearest, ties to even)."""
    x = np.asarray(x, np.float32)
    if fmt == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits, fmt):
    bits = np.asarray(bits, np.uint16)
    if fmt == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def pair(lo, hi):
    return np.uint32(lo) | np.uint32(hi) << np.uint32(16)


def lanes():
    """(lane, g, t) for the 32 lanes: groupID and threadID_in_group."""
    return [(lane, lane // 4, lane % 4) for lane in range(32)]


def a_fragments(A):
    """A (16x16 uint16, row-major) -> 32 x 4 .b32: a[i] holds A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}]."""
    out = np.empty((32, 4), np.uint32)
    for lane, g, t in lanes():
        for i in range(4):
            r, c = g + 8 * (i & 1), 2 * t + 8 * (i >> 1)
            out[lane, i] = pair(A[r, c], A[r, c + 1])
    return out


def b_fragments(B):
    """B (16x8 uint16, K x N) -> 32 x 2 .b32: b[i] holds B[2t + 8 i + {0, 1}][g]."""
    out = np.empty((32, 2), np.uint32)
    for lane, g, t in lanes():
        for i in range(2):
            k = 2 * t + 8 * i
            out[lane, i] = pair(B[k, g], B[k + 1, g])
    return out


def c_fragments(C):
    """C (16x8 float32) -> 32 x 4: c[i] = C[g + 8 (i >> 1)][2t + (i & 1)]."""
    out = np.empty((32, 4), np.float32)
    for lane, g, t in lanes():
        for i in range(4):
            out[lane, i] = C[g + 8 * (i >> 1), 2 * t + (i & 1)]
    return out


def c_matrix(frags):
    """The inverse of c_fragments."""
    C = np.empty((16, 8), np.float32)
    for lane, g, t in lanes():
        for i in range(4):
            C[g + 8 * (i >> 1), 2 * t + (i & 1)] = frags[lane, i]
    return C


def mma(fmt, A, B, C):
    d = garbage((32, 4), np.float32)
    kernel(f"mma_fragments<{CUDA_NAME[fmt]}>")((1,), (32,), (a_fragments(A), b_fragments(B), c_fragments(C), d))
    return c_matrix(d)


# ----------------------------------------------------------------------------
# mma.m16n8k16: each operand's layout, element by element


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_c_and_d_layout(fmt):
    C = np.arange(128, dtype=np.float32).reshape(16, 8) - 40
    zeros = np.zeros((16, 16), np.uint16)
    np.testing.assert_array_equal(mma(fmt, zeros, zeros[:, :8], C), C)


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_a_layout(fmt, rng):
    A = rng.integers(-64, 64, (16, 16)).astype(np.float32)
    for half in range(2):  # B picks columns 0-7, then 8-15, of A
        B = np.zeros((16, 8), np.float32)
        B[8 * half:8 * half + 8] = np.eye(8)
        got = mma(fmt, to_bits(A, fmt), to_bits(B, fmt), np.zeros((16, 8), np.float32))
        np.testing.assert_array_equal(got, A[:, 8 * half:8 * half + 8])


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_b_layout(fmt, rng):
    B = rng.integers(-64, 64, (16, 8)).astype(np.float32)
    got = mma(fmt, to_bits(np.eye(16), fmt), to_bits(B, fmt), np.zeros((16, 8), np.float32))
    np.testing.assert_array_equal(got, B)


@pytest.mark.parametrize("fmt", NARROW)
def test_mma_random(fmt, rng):
    A, B = (to_bits(rng.standard_normal(shape), fmt) for shape in ((16, 16), (16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    want = from_bits(A, fmt).astype(np.float64) @ from_bits(B, fmt) + C
    np.testing.assert_allclose(mma(fmt, A, B, C), want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# ldmatrix: every variant against the ISA's thread mapping


def ldmatrix_numpy(tile, row_offsets, num, trans):
    """Register m of lane l: elements (l / 4, 2 (l % 4) + {0, 1}) of matrix m (transposed with .trans),
    whose row r is the 8 elements at the address lane 8 m + r supplies."""
    out = np.empty((32, num), np.uint32)
    for m in range(num):
        M = np.stack([tile[o:o + 8] for o in row_offsets[8 * m:8 * m + 8]])
        if trans:
            M = M.T
        for lane, g, t in lanes():
            out[lane, m] = pair(M[g, 2 * t], M[g, 2 * t + 1])
    return out


@pytest.mark.parametrize("num,trans", LDMATRIX, ids=[f"x{n}{'.trans' if t else ''}" for n, t in LDMATRIX])
def test_ldmatrix(num, trans, rng):
    rows = 64
    tile = rng.permutation(rows * 8).astype(np.uint16)
    # 32 distinct rows in random order; lanes past 8 num supply no address (null: must not be read)
    offsets = (rng.permutation(rows)[:32] * 8).astype(np.int32)
    offsets[8 * num:] = -1
    out = garbage((32, num), np.uint32)
    kernel(f"ldmatrix_variant<{num}, {str(trans).lower()}>")(
        (1,), (32,), (tile, np.int32(tile.size), offsets, out), shared_mem=tile.nbytes)
    np.testing.assert_array_equal(out, ldmatrix_numpy(tile, offsets, num, trans))


# ----------------------------------------------------------------------------
# the whole pipeline: cp.async -> ldmatrix -> mma


def tile_matmul(fmt, A, B, a_rows=16, wait_mode=0, order="ascending"):
    d = garbage((16, 8), np.float32)
    kernel(f"tile_matmul<{CUDA_NAME[fmt]}>", order)(
        (1,), (32,), (A, B, d, np.int32(a_rows), np.int32(wait_mode)), shared_mem=(16 * 16 + 16 * 8) * 2)
    return d


def narrow(x, fmt):
    """x rounded to fmt, as the array the kernel takes (float16, or uint16 bfloat16 patterns)."""
    return x.astype(np.float16) if fmt == "float16" else to_bits(x, fmt)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("a_rows", [16, 11])
def test_tile_matmul_matches_numpy(fmt, order, a_rows, rng):
    A, B = narrow(rng.standard_normal((16, 16)), fmt), narrow(rng.standard_normal((16, 8)), fmt)
    a = from_bits(A.view(np.uint16), fmt).astype(np.float64)
    a[a_rows:] = 0  # cp.async zero-fills the rows past a_rows
    want = a @ from_bits(B.view(np.uint16), fmt)
    np.testing.assert_allclose(tile_matmul(fmt, A, B, a_rows, order=order), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("wait_mode", [1, 2], ids=["no-wait", "wait-for-a-only"])
def test_missing_cp_async_wait_gives_a_wrong_answer(wait_mode, rng):
    fmt = "float16"
    A, B = narrow(rng.standard_normal((16, 16)), fmt), narrow(rng.standard_normal((16, 8)), fmt)
    got = tile_matmul(fmt, A, B, wait_mode=wait_mode)
    # B never landed: shared memory still holds the 0xFF bytes every block starts with (NaN)
    assert np.isnan(got).all()


def test_pack_and_exp(rng):
    x = np.concatenate([rng.standard_normal(58) * 4, [1 + 2**-11, 1 + 3 * 2**-11, -130.0, np.nan, 1e5, -200.0]])
    x = x.astype(np.float32)
    f16, bf16 = garbage(32, np.uint32), garbage(32, np.uint32)
    e = garbage(32, np.float32)
    kernel("pack_and_exp")((1,), (32,), (x, f16, bf16, e))
    for got, fmt in ((f16, "float16"), (bf16, "bfloat16")):
        bits = to_bits(x, fmt)
        bits[np.isnan(x)] = 0x7FFF  # the GPU's cvt gives the canonical NaN
        np.testing.assert_array_equal(got, pair(bits[0::2], bits[1::2]))
    want = np.exp2(x[:32].astype(np.float64))
    want[want < np.finfo(np.float32).tiny] = 0  # .ftz
    np.testing.assert_allclose(e, want, rtol=2e-7)


@pytest.mark.parametrize("mode,message,thread", [
    (0, r"mma\.sync needs all 32 lanes of the warp, but lanes 0x80000000 have exited", None),
    (1, r"ldmatrix row address: address .* is not aligned", None),
    (2, r"cp\.async destination: address .* is not in shared memory", None),
    (3, r"exited with 1 cp\.async copy not waited for \(0 not even committed\)", (0, 0, 0)),
    (4, r"exited with 1 cp\.async copy not waited for \(1 not even committed\)", (0, 0, 0)),
])
@pytest.mark.parametrize("cp_async", CP_ASYNC_MODES)
def test_misuse_is_reported(mode, message, thread, cp_async):
    module = EmulatedModule(source(), ["tensor_core_misuse"], (INCLUDE,), cp_async=cp_async)
    with pytest.raises(KernelError, match=message) as caught:
        module.get_function("tensor_core_misuse")((1,), (32,), (np.int32(mode), np.zeros(32, np.uint32)))
    if thread is not None:
        assert caught.value.thread == thread


# ----------------------------------------------------------------------------
# NVRTC: the same kernels compile for sm_80 and sm_90, to tensor-core SASS


def compile_for(arch, source_text, names, options=()):
    """{name expression: (ptxas info, SASS text of that function)} from NVRTC and nvdisasm."""
    log, lowered, cubin = nvrtc.compile_cubin(source_text, names, nvrtc.compile_options(arch) + tuple(options))
    info = nvrtc.parse_ptxas(log)
    text = nvrtc.sass(cubin)
    return {name: (info[lowered[name]], nvrtc.function_sass(text, lowered[name])) for name in names}


@pytest.mark.parametrize("arch", ARCHS)
def test_test_kernels_compile_without_spills(arch):
    for name, (info, _) in compile_for(arch, source(), NAMES, (INCLUDE,)).items():
        assert info["spill_stores"] + info["spill_loads"] == 0, f"{arch} {name}: {info}"


@pytest.mark.parametrize("arch", ARCHS)
def test_sass_has_tensor_core_instructions(arch):
    names = [f"tile_matmul<{t}>" for t in CUDA_NAME.values()]
    for (name, (_, sass)), dtype in zip(compile_for(arch, source(), names, (INCLUDE,)).items(), ("", ".BF16")):
        assert sass is not None, f"{arch} {name}: not in the disassembly"
        assert re.search(rf"\bHMMA\.16816\.F32{re.escape(dtype)} ", sass), f"{arch} {name}: no HMMA.16816"
        assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.2" in sass, f"{arch} {name}: no LDSM"
        assert "LDGSTS" in sass, f"{arch} {name}: no LDGSTS (cp.async)"


# ----------------------------------------------------------------------------
# the tensor-core forward kernel (kernels/attn_fwd_tc.cu), through the cupy backend's own
# dispatch and launch code under the emulator (tests/cupy_emulation.py)

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal): lengths not a multiple of
# the 64-row tiles, Sq > Sk (fully masked rows) and Sq < Sk with causal, GQA, head_dim 40 < 64
TC_CASES = (
    (1, 17, 17, 1, 1, 64, False),
    (1, 70, 130, 2, 1, 64, True),
    (1, 80, 33, 1, 1, 40, True),
    (2, 33, 70, 1, 1, 128, False),
)

# (thread order, cp.async mode): the two orders of every emulated test, and warps drifting apart
# with copies landing as soon as they are issued (see tests/emulator/__init__.py)
SCHEDULES = (("ascending", "deferred"), ("descending", "deferred"), ("warp_skew", "eager"))


def tc_inputs(rng, case, fmt):
    """q, k, v as the user passes them: float16 arrays, or bfloat16 bit patterns in uint16."""
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float32)
    return tuple(narrow(x, fmt) for x in (q, k, v))


def tc_forward(q, k, v, fmt, causal, schedule, compile=compile_module):
    """(out, lse) from backend="cupy", asserting that it took the tensor-core path."""
    dtype = "bfloat16" if fmt == "bfloat16" else None
    order, cp_async = schedule
    with emulated(order, cp_async=cp_async, compile=compile):
        p = flashcupy._api._problem(q, k, v, causal, None, dtype)
        assert cupy_backend.forward_path(p, q, k, v) == "tensor-core"
        return flashcupy.attention(q, k, v, causal=causal, return_lse=True, backend="cupy", dtype=dtype)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else ""))
def test_attn_fwd_tc_matches_oracle(case, fmt, schedule, rng):
    q, k, v = tc_inputs(rng, case, fmt)
    causal = case[6]
    out, lse = tc_forward(q, k, v, fmt, causal, schedule)
    want_out, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True, dtype=fmt)
    assert_close(out, want_out, fmt, q, k, what="out")
    assert_close(lse, want_lse, fmt, q, k, what="lse")


@pytest.mark.parametrize("case, why", [
    ((1, 20, 20, 1, 1, 100, False), "head_dim not a multiple of 8"),
    ((1, 20, 20, 1, 1, 256, False), "head_dim above 128"),
])
def test_uncovered_shapes_fall_back_to_simt(case, why, rng):
    q, k, v = tc_inputs(rng, case, "float16")
    with emulated():
        p = flashcupy._api._problem(q, k, v, False, None, None)
        assert cupy_backend.forward_path(p, q, k, v) == "simt", why
        out = flashcupy.attention(q, k, v, backend="cupy")
    assert_close(out, reference.attention(q, k, v), "float16", q, k)


def test_strided_head_dim_and_old_gpus_fall_back_to_simt(rng):
    q, k, v = tc_inputs(rng, (1, 20, 20, 1, 1, 64, False), "float16")
    with emulated():
        p = flashcupy._api._problem(q, k, v, False, None, None)
        assert cupy_backend.forward_path(p, q[..., ::-1], k, v) == "simt"
    with emulated(compute_capability=75):
        assert cupy_backend.forward_path(p, q, k, v) == "simt"


# each line the kernel cannot do without, and the schedule under which its absence shows (the last
# pass's wait<0> stays: without it the emulator reports the copies left in flight at exit, before
# any answer; tests/emulator checks that report)
TC_ESSENTIAL = {
    "cp.async wait of a prefetching pass": (r"cp_async_wait<1>\(\);", ("ascending", "deferred")),
    "barrier before reading K_j, V_j": (r"__syncthreads\(\);(?=  // \.\.\. and every other thread's)",
                                        ("warp_skew", "deferred")),
    "barrier before the prefetch": (r"__syncthreads\(\);(?=  // every warp is done with this stage)",
                                    ("warp_skew", "eager")),
}


@pytest.mark.parametrize("what", TC_ESSENTIAL)
def test_attn_fwd_tc_fails_without_each_wait_and_barrier(what, rng):
    pattern, schedule = TC_ESSENTIAL[what]

    def without(source, names, options, thread_order, seed, cp_async):
        if "attn_fwd_tc" in source:
            source, count = re.subn(pattern, "", source)
            assert count, f"{what}: not found in attn_fwd_tc.cu"
        return compile_module(source, names, options, thread_order, seed, cp_async)

    case = TC_CASES[1]  # three key blocks: both stages are reused
    q, k, v = tc_inputs(rng, case, "float16")
    want = reference.attention(q, k, v, causal=case[6])
    out, _ = tc_forward(q, k, v, "float16", case[6], schedule, compile=without)
    with pytest.raises(AssertionError):
        assert_close(out, want, "float16", q, k)


# causal with seqlen_q - seqlen_k = 130: the rows of the first two 64-row query blocks see no key, so
# the forward and dQ CTAs of those blocks have no key block to visit
NO_KEY_CASE = (1, 150, 20, 1, 1, 64, True)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
def test_ctas_without_a_key_block_write_zeros_and_leave_no_copy_in_flight(schedule, rng):
    # the emulator fails the launch if a thread exits with cp.async copies in flight
    q, k, v, dout, grads = tc_gradients(rng, NO_KEY_CASE, "float16", schedule)
    out, lse = tc_forward(q, k, v, "float16", True, schedule)
    unseen = NO_KEY_CASE[1] - NO_KEY_CASE[2]
    assert (out[:, :unseen] == 0).all() and np.isneginf(lse[..., :unseen]).all()
    want_out, want_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, want_out, "float16", q, k, what="out")
    assert_close(lse, want_lse, "float16", q, k, what="lse")
    for name, got, want in zip(("dq", "dk", "dv"), grads, reference.attention_backward(dout, q, k, v, causal=True)):
        assert_close(got, want, "float16", q, k, what=name)


def test_a_cta_leaving_a_copy_in_flight_is_caught(rng):
    # attn_fwd_tc.cu as it was: the Q tile's cp.async issued even where there is no key block to visit
    def q_copy_always(source, names, options, thread_order, seed, cp_async):
        if "attn_fwd_tc" in source:
            guard, q_load = r"(    if \(kv_blocks > 0\) \{\n)", r"(\s*load_tile_async<BLOCK_M, HEAD_DIM>\(Q_s[^\n]*\n)"
            source, count = re.subn(guard + q_load, r"\2\1", source)
            assert count == 1, "the guarded Q tile load is not in attn_fwd_tc.cu"
        return compile_module(source, names, options, thread_order, seed, cp_async)

    q, k, v = tc_inputs(rng, NO_KEY_CASE, "float16")
    with pytest.raises(KernelError, match=r"exited with \d+ cp\.async copies not waited for") as caught:
        tc_forward(q, k, v, "float16", True, SCHEDULES[0], compile=q_copy_always)
    # blocks 1 and 2 are query blocks 1 and 0 (the grid runs the last query block first)
    assert caught.value.block in ((1, 0, 0), (2, 0, 0))


@pytest.mark.parametrize("arch", ARCHS)
def test_attn_fwd_tc_compiles_to_tensor_cores_without_spills(arch):
    kernels = [specs.tc_forward_module(fmt, d).kernels[0] for fmt in NARROW for d in specs.TC_HEAD_DIM_BUCKETS]
    compiled = compile_for(arch, sources.read_source("attn_fwd_tc.cu"), [k.name_expression for k in kernels])
    for kern in kernels:
        info, sass = compiled[kern.name_expression]
        name = kern.name_expression
        print(f"{arch} {name}: {info['registers']} registers, {info['spill_stores'] + info['spill_loads']} "
              f"spill bytes, {len(re.findall(r'HMMA', sass))} HMMA")
        assert info["spill_stores"] + info["spill_loads"] == 0 and info["registers"] <= 255, f"{arch} {name}: {info}"
        # one pass of the key loop: (HEAD_DIM / 16) (BLOCK_N / 8) for S, (BLOCK_N / 16) (HEAD_DIM / 8) for P V
        mmas = kern.head_dim // 16 * kern.block_n // 8 + kern.block_n // 16 * kern.head_dim // 8
        assert len(re.findall(r"\bHMMA\.16816\.F32", sass)) >= mmas, f"{arch} {name}: too few HMMA"
        assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.4" in sass and "LDGSTS" in sass


# ----------------------------------------------------------------------------
# the tensor-core backward (kernels/attn_bwd_tc.cu): flash_bwd_preprocess, attn_bwd_dkdv_tc and
# attn_bwd_dq_tc, through the backend's dispatch and launch code under the emulator, on the out
# and lse of the tensor-core forward


def tc_backward(dout, q, k, v, out, lse, fmt, causal, schedule, compile=compile_module):
    """(dq, dk, dv) from backend="cupy", asserting that it took the tensor-core path."""
    dtype = "bfloat16" if fmt == "bfloat16" else None
    order, cp_async = schedule
    with emulated(order, cp_async=cp_async, compile=compile):
        p = flashcupy._api._problem(q, k, v, causal, None, dtype)
        assert cupy_backend.backward_path(p, dout, q, k, v, out) == "tensor-core"
        return flashcupy.attention_backward(dout, q, k, v, out, lse, causal=causal, backend="cupy", dtype=dtype)


def tc_gradients(rng, case, fmt, schedule=SCHEDULES[0], compile=compile_module):
    """(q, k, v, dout, (dq, dk, dv)): the forward and backward on tensor cores, the forward under
    the default schedule, the backward under `schedule` and `compile`."""
    q, k, v = tc_inputs(rng, case, fmt)
    dout = narrow(rng.standard_normal(q.shape), fmt)
    causal = case[6]
    out, lse = tc_forward(q, k, v, fmt, causal, SCHEDULES[0])
    return q, k, v, dout, tc_backward(dout, q, k, v, out, lse, fmt, causal, schedule, compile)


@pytest.mark.parametrize("schedule", SCHEDULES, ids="-".join)
@pytest.mark.parametrize("fmt", NARROW)
@pytest.mark.parametrize("case", TC_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else ""))
def test_attn_bwd_tc_matches_oracle(case, fmt, schedule, rng):
    q, k, v, dout, grads = tc_gradients(rng, case, fmt, schedule)
    B, Sq, Sk, Hq, Hkv, D, causal = case
    want = reference.attention_backward(dout, q, k, v, causal=causal, dtype=fmt)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == q.dtype and got.shape == w.shape
        assert_close(got, w, fmt, q, k, what=name)
    if causal and Sq > Sk:  # the first Sq - Sk rows see no key: their dq is exactly 0
        assert (grads[0][:, :Sq - Sk] == 0).all()


def test_backward_with_strided_dout_or_out_falls_back_to_simt(rng):
    case = (1, 20, 20, 1, 1, 64, False)
    q, k, v = tc_inputs(rng, case, "float16")
    dout = narrow(rng.standard_normal(q.shape), "float16")
    with emulated():
        out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="cupy")
        p = flashcupy._api._problem(q, k, v, False, None, None)
        assert cupy_backend.backward_path(p, dout, q, k, v, out) == "tensor-core"
        assert cupy_backend.backward_path(p, dout, q, k, v, out[..., ::-1]) == "simt"
        strided = np.empty(dout.shape[:3] + (2 * dout.shape[3],), dout.dtype)[..., ::2]
        strided[...] = dout
        assert cupy_backend.backward_path(p, strided, q, k, v, out) == "simt"
        grads = flashcupy.attention_backward(strided, q, k, v, out, lse, backend="cupy")
    for name, got, w in zip(("dq", "dk", "dv"), grads, reference.attention_backward(dout, q, k, v)):
        assert_close(got, w, "float16", q, k, what=name)


# each line the backward cannot do without: (pattern, what replaces it, the schedule under which its
# absence shows, the gradients it spoils). A wait is kept on the last pass only, so that the copies
# are drained before the threads exit (else the emulator reports them, before any answer).
TC_BWD_ESSENTIAL = {
    "dK/dV: cp.async wait": (r"cp_async_wait<1>\(\);(?=  // this thread's copies of pass p)",
                             "if (p + 1 == passes) cp_async_wait<0>();", ("ascending", "deferred"), ("dk", "dv")),
    "dK/dV: barrier before reading the stage": (r"__syncthreads\(\);(?=  // \.\.\. and every thread's, with)", "",
                                                ("warp_skew", "deferred"), ("dk", "dv")),
    "dK/dV: barrier before the prefetch": (r"__syncthreads\(\);(?=  // every warp is done with this Q_i)", "",
                                           ("warp_skew", "eager"), ("dk", "dv")),
    "dQ: cp.async wait": (r"cp_async_wait<1>\(\);(?=  // this thread's copies of K_j, V_j)",
                          "if (jb + 1 == kv_blocks) cp_async_wait<0>();", ("ascending", "deferred"), ("dq",)),
    "dQ: barrier before reading the stage": (r"__syncthreads\(\);(?=  // \.\.\. and every thread's: the tiles)", "",
                                             ("warp_skew", "deferred"), ("dq",)),
    "dQ: barrier before the prefetch": (r"__syncthreads\(\);(?=  // every warp is done with K_j, V_j)", "",
                                        ("warp_skew", "eager"), ("dq",)),
}


@pytest.mark.parametrize("what", TC_BWD_ESSENTIAL)
def test_attn_bwd_tc_fails_without_each_wait_and_barrier(what, rng):
    pattern, replacement, schedule, spoiled = TC_BWD_ESSENTIAL[what]

    def without(source, names, options, thread_order, seed, cp_async):
        if "attn_bwd_dkdv_tc" in source:
            source, count = re.subn(pattern, replacement, source)
            assert count == 1, f"{what}: found {count} times in attn_bwd_tc.cu"
        return compile_module(source, names, options, thread_order, seed, cp_async)

    case = TC_CASES[1]  # GQA, causal: up to 4 passes of (query head, query block) per key block, 3 key blocks
    q, k, v, dout, grads = tc_gradients(rng, case, "float16", schedule, without)
    want = dict(zip(("dq", "dk", "dv"), reference.attention_backward(dout, q, k, v, causal=case[6])))
    for name, got in zip(("dq", "dk", "dv"), grads):
        if name in spoiled:
            with pytest.raises(AssertionError):
                assert_close(got, want[name], "float16", q, k, what=name)
        else:  # the other kernel is untouched
            assert_close(got, want[name], "float16", q, k, what=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_attn_bwd_tc_compiles_to_tensor_cores_without_spills(arch):
    modules = [specs.tc_backward_module(fmt, d) for fmt in NARROW for d in specs.TC_HEAD_DIM_BUCKETS]
    kernels = [kern for m in modules for kern in m.kernels if kern.tensor_cores]
    compiled = compile_for(arch, sources.read_source("attn_bwd_tc.cu"), [k.name_expression for k in kernels])
    for kern in kernels:
        info, sass = compiled[kern.name_expression]
        name = kern.name_expression
        print(f"{arch} {name}: {info['registers']} registers, {info['spill_stores'] + info['spill_loads']} "
              f"spill bytes, {len(re.findall(r'HMMA', sass))} HMMA")
        assert info["spill_stores"] + info["spill_loads"] == 0 and info["registers"] <= 255, f"{arch} {name}: {info}"
        dtype = ".BF16" if kern.dtype == "bfloat16" else ""
        assert re.search(rf"\bHMMA\.16816\.F32{re.escape(dtype)} ", sass), f"{arch} {name}: no HMMA.16816"
        # ldmatrix of the stored tiles (Sᵀ or S, dPᵀ or dP) and transposed (dV, dK or dQ); cp.async
        assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.4" in sass and "LDGSTS" in sass, f"{arch} {name}"
