"""The numba backend against the float64 oracle: on the CUDA simulator here, on a GPU when present.

numba.cuda decides once, when it is first imported, whether it is the simulator
(NUMBA_ENABLE_CUDASIM=1) or the real thing. This module decides before importing it:
- NUMBA_ENABLE_CUDASIM set in the environment: respected as it is;
- unset and no CUDA device: the simulator, and the variable is removed again once
  numba.cuda is imported, so subprocesses of later tests do not inherit it;
- unset and a CUDA device present: the real device.
The simulator runs the "simulator" battery (tiny shapes: every simulated CUDA
thread is a Python thread); a real device runs the "gpu" battery (@pytest.mark.gpu:
the same checks on the shared CASES too, and on CuPy and numba device arrays).
Each battery skips cleanly where its device is absent.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import CASES, DTYPES, LAYOUTS, assert_close, make_qkv, reference, strided_empty


def _gpu_present() -> bool:
    """A CUDA device answers the driver, asked without importing numba."""
    try:
        from cuda.bindings import driver
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # no bindings, no driver library
        return False


_NUMBA_CUDA_PREIMPORTED = "numba.cuda" in sys.modules
_WE_SET_SIM = (not _NUMBA_CUDA_PREIMPORTED and "NUMBA_ENABLE_CUDASIM" not in os.environ
               and not _gpu_present())
if _WE_SET_SIM:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
try:
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install flashcupy[numba])")
finally:
    if _WE_SET_SIM:
        del os.environ["NUMBA_ENABLE_CUDASIM"]

import flashcupy  # noqa: E402
from flashcupy.backends import numba_backend  # noqa: E402
from flashcupy.backends.numba_backend import kernels  # noqa: E402

SIMULATOR = kernels.SIMULATOR
GPU = not SIMULATOR and cuda.is_available()

if _NUMBA_CUDA_PREIMPORTED and not SIMULATOR and not GPU:
    raise RuntimeError(
        "numba.cuda was imported without the simulator before tests/test_numba_backend.py, and there "
        "is no GPU: the numba backend cannot be tested in this process. Set NUMBA_ENABLE_CUDASIM=1 in "
        "the environment (or at the top of tests/conftest.py) so numba.cuda starts as the simulator.")

# Tiny shapes for the simulator, chosen against its tiles (BLOCK_Q 4, BLOCK_K 2, D_TILE 8):
# lengths 1, 5, 17 leave partial tiles; head_dim 1, 3, 40 (40: five D_TILE chunks, partial
# register lanes). (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal)
SMALL_CASES = (
    (1, 1, 1, 1, 1, 1, False),
    (2, 5, 5, 2, 2, 3, True),
    (1, 5, 17, 2, 1, 40, True),      # Sq < Sk, MQA, several head-dim chunks
    (1, 17, 5, 4, 2, 3, True),       # Sq > Sk: rows 0..11 see no key, GQA
    (2, 5, 17, 3, 3, 1, False),
)


@pytest.fixture(autouse=True)
def _quick_thread_switches():
    """Under the simulator, hand the GIL over every 0.2 ms instead of every 5 ms (3-4x faster).

    Its block manager busy-polls the block's Python threads to release them from
    cuda.syncthreads(); with the default switch interval every barrier costs milliseconds.
    """
    if not SIMULATOR:
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(old)


def _battery(cases):
    """The simulator runs SMALL_CASES; a GPU runs them and the shared CASES."""
    params = [pytest.param("simulator", c, id=f"sim-{c}") for c in cases]
    params += [pytest.param("gpu", c, id=f"gpu-{c}", marks=pytest.mark.gpu) for c in cases + CASES]
    return params


def _require(device):
    if device == "simulator" and not SIMULATOR:
        pytest.skip("numba.cuda is not the simulator in this process (the gpu battery covers these cases)")
    if device == "gpu" and not GPU:
        pytest.skip("no CUDA GPU in this process" + (" (numba.cuda is the simulator)" if SIMULATOR else ""))


def _forward_and_backward(q, k, v, dtype, causal, rng, to_device=lambda x: x, to_host=np.asarray):
    """Forward and backward through the public API, each result against the oracle; returns them."""
    out, lse = flashcupy.attention(to_device(q), to_device(k), to_device(v), causal=causal,
                                   return_lse=True, backend="numba")
    out, lse = to_host(out), to_host(lse)
    want_out, want_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, want_out, dtype, q, k, what="out")
    assert_close(lse, want_lse, dtype, q, k, what="lse")

    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = flashcupy.attention_backward(*map(to_device, (dout, q, k, v, out, lse)), causal=causal, backend="numba")
    grads = tuple(map(to_host, grads))
    want = reference.attention_backward(dout, q, k, v, causal=causal)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert_close(g, w, dtype, q, k, what=name)
    return out, lse, grads


# ----------------------------------------------------------------------------
# the battery: NumPy inputs (copied to the device and back)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("device, case", _battery(SMALL_CASES))
def test_battery(rng, device, case, dtype):
    _require(device)
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype)
    out, lse, (dq, dk, dv) = _forward_and_backward(q, k, v, dtype, causal, rng)
    if causal and Sq > Sk:  # rows that see no key: out 0, lse -inf, dq 0, never NaN
        masked = slice(0, Sq - Sk)
        assert np.all(out[:, masked] == 0) and np.all(np.isneginf(lse[:, :, masked]))
        assert np.all(dq[:, masked] == 0)
        assert not any(np.isnan(x).any() for x in (out, dq, dk, dv))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_strided_views_are_read_in_place(rng, device, layout):
    """Transposed, sliced and reversed q/k/v, and strided dout, out and lse in the backward."""
    _require(device)
    dtype = np.float32
    B, Sq, Sk, Hq, Hkv, D = (1, 5, 7, 2, 1, 10) if device == "simulator" else (2, 67, 45, 4, 2, 72)
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, dtype, layout=layout)
    out, lse = flashcupy.attention(q, k, v, causal=True, return_lse=True, backend="numba")
    want_out, want_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, want_out, dtype, q, k, what="out")
    assert_close(lse, want_lse, dtype, q, k, what="lse")

    dout, out_s = strided_empty(q.shape, dtype, layout), strided_empty(q.shape, dtype, layout)
    dout[...] = rng.standard_normal(q.shape)
    out_s[...] = out
    lse_s = np.empty((B, Sq, Hq), lse.dtype).transpose(0, 2, 1)  # (B, H, S) view of a (B, S, H) array
    lse_s[...] = lse
    grads = flashcupy.attention_backward(dout, q, k, v, out_s, lse_s, causal=True, backend="numba")
    for name, g, w in zip(("dq", "dk", "dv"), grads, reference.attention_backward(dout, q, k, v, causal=True)):
        assert_close(g, w, dtype, q, k, what=name)


# ----------------------------------------------------------------------------
# device arrays: the simulator's arrays have no __cuda_array_interface__, so GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL_CASES + CASES, ids=str)
def test_numba_device_arrays_in_and_out(rng, case):
    _require("gpu")
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = make_qkv(rng, B, Sq, Sk, Hq, Hkv, D, np.float16)
    out = flashcupy.attention(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), causal=causal,
                              backend="numba")
    assert cuda.is_cuda_array(out) and not isinstance(out, np.ndarray)
    _forward_and_backward(q, k, v, np.float16, causal, rng, cuda.to_device, lambda x: x.copy_to_host())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cupy_arrays_in_and_out(rng, layout, dtype):
    _require("gpu")
    cupy = pytest.importorskip("cupy")
    q, k, v = make_qkv(rng, 2, 67, 45, 4, 2, 72, dtype, layout=layout)

    def to_device(x):  # the same strides on the device: a view of a copy of x's whole base
        base = x.base if x.base is not None else x
        dev = cupy.asarray(base)
        offset = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return cupy.ndarray(x.shape, x.dtype, dev.data + offset, strides=x.strides)

    out = flashcupy.attention(to_device(q), to_device(k), to_device(v), backend="numba")
    assert isinstance(out, cupy.ndarray)
    _forward_and_backward(q, k, v, dtype, True, rng, to_device, cupy.asnumpy)


# ----------------------------------------------------------------------------
# availability, imports, compilation


def test_nan_in_a_query_row_stays_in_that_row(rng):
    q, k, v = make_qkv(rng, 1, 5, 6, 1, 1, 3, np.float32)
    q[0, 2, 0, 1] = np.nan
    out, lse = flashcupy.attention(q, k, v, return_lse=True, backend="numba")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(reference.attention(q, k, v)))
    assert np.isnan(out[0, 2]).all() and np.isnan(lse[0, 0, 2])
    assert np.isfinite(np.delete(out, 2, axis=1)).all()


def test_available_exactly_where_a_device_or_the_simulator_is():
    assert (numba_backend.unavailable_reason() is None) == (SIMULATOR or GPU)
    assert numba_backend.simulated() == SIMULATOR


def test_head_dim_above_the_register_tiles_is_refused(rng):
    if not (SIMULATOR or GPU):
        pytest.skip("neither the simulator nor a GPU in this process")
    q, k, v = make_qkv(rng, 1, 1, 1, 1, 1, numba_backend.MAX_HEAD_DIM + 1, np.float32)
    with pytest.raises(ValueError, match="head_dim up to"):
        flashcupy.attention(q, k, v, backend="numba")


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_flashcupy_import_does_not_import_numba():
    r = _python("import sys, flashcupy; flashcupy.attention; assert 'numba' not in sys.modules, 'numba imported'")
    assert r.returncode == 0, r.stderr


def test_unavailable_reason_without_a_device():
    if _gpu_present():
        pytest.skip("a GPU is present")
    r = _python("from flashcupy.backends import unavailable_reason; print(unavailable_reason('numba'))",
                NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout and "NUMBA_ENABLE_CUDASIM=1" in r.stdout


def test_kernels_compile_for_a_real_gpu():
    """Every kernel x dtype through NVVM to PTX: the typing the simulator never does (no GPU needed)."""
    r = subprocess.run([sys.executable, "-m", "flashcupy.backends.numba_backend.tools", "ptx"],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert r.returncode == 0, r.stdout + r.stderr  # 3: NVVM missing, which the test extra installs
