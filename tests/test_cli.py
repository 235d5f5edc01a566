"""The command line: check catches a wrong backend, bench reports by the standard formula."""

import json

import numpy as np
import pytest

from flashcupy.tools import bench
from flashcupy.__main__ import _hopper_tiles, main
from flashcupy.backends import cupy_backend, numpy_backend


def test_check_passes_on_the_numpy_backend(capsys):
    # the battery's first three cases, then the feature cases: v's own head dim, dropout, a window
    # with the softcap and ALiBi, each row saying which
    assert main(["check", "--backend", "numpy", "--cases", "3"]) == 0
    out = capsys.readouterr().out
    assert "all passed" in out
    rows = [line for line in out.splitlines() if line.startswith("numpy ")]
    assert len(rows) == 4 * (3 + 3)
    for shown in ("Dv=32", "dropout_p=0.2", "window=(5, 3) softcap=4.0 alibi"):
        assert sum(line.endswith(shown) for line in rows) == 4, shown


def test_check_fails_loudly_on_a_wrong_backend(capsys, monkeypatch):
    real = numpy_backend.forward

    def off_by_a_little(p, q, k, v):
        out, lse = real(p, q, k, v)
        return out * np.asarray(1.01, out.dtype), lse

    monkeypatch.setattr(numpy_backend, "forward", off_by_a_little)
    assert main(["check", "--backend", "numpy", "--cases", "2", "--dtype", "float32"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("numpy", "cupy", "numba"):
        assert name in out


def test_info_reports_the_hopper_tiles_each_switch_picks(monkeypatch):
    # the rules' tiles, not a copy of them: turning a switch on changes the line
    line = _hopper_tiles()
    assert "forward\n  64: 128x128, 128: 128x128, 192: 128x80, 256: 128x80; backward 64: 64x128, 128: 64x128" in line
    assert "SM90_WIDE off, SM90_TALL_FORWARD off, SM90_TALL_BACKWARD off, SM90_PERSISTENT off" in line
    monkeypatch.setattr(cupy_backend, "SM90_WIDE", True)
    monkeypatch.setattr(cupy_backend, "SM90_TALL_BACKWARD", True)
    line = _hopper_tiles()
    assert "forward\n  64: 128x192, 128: 128x176, 192: 128x80, 256: 128x80; backward 64: 128x128, 128: 64x128" in line
    assert "SM90_WIDE on, SM90_TALL_FORWARD off, SM90_TALL_BACKWARD on, SM90_PERSISTENT off" in line
    monkeypatch.setattr(cupy_backend, "SM90_TALL_FORWARD", True)  # before the wide block at 64
    line = _hopper_tiles()
    assert "forward\n  64: 192x128, 128: 128x176, 192: 128x80, 256: 128x80; backward" in line
    assert "SM90_WIDE on, SM90_TALL_FORWARD on, SM90_TALL_BACKWARD on" in line


@pytest.mark.parametrize("causal", [False, True])
def test_bench_counts_flops_by_the_standard_formula(tmp_path, causal):
    path = tmp_path / "r.json"
    assert main(["bench", "--impl", "numpy", "--impl", "naive-numpy", "--seqlen", "64", "--heads", "2",
                 "--head-dim", "16", "--repeat", "1", "--min-time", "0"] + (["--causal"] if causal else [])
                + ["--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert {(r["impl"], r["pass_"]) for r in rows} == {
        (i, p) for i in ("numpy", "naive-numpy") for p in ("forward", "backward")}
    for r in rows:
        fwd = 4 * 1 * 2 * 64 * 64 * 16 / (2 if causal else 1)
        want = fwd * (2.5 if r["pass_"] == "backward" else 1)
        assert r["tflops"] * r["seconds"] * 1e12 == pytest.approx(want)



def test_bench_times_a_window_and_a_bias(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "--impl", "numpy", "--impl", "naive-numpy", "--impl", "torch-sdpa", "--seqlen", "64",
                 "--heads", "2", "--head-dim", "16", "--repeat", "1", "--min-time", "0", "--causal",
                 "--window", "7,none", "--bias", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "window=(7, None) bias=(1, H, S, S)" in captured.out
    assert "torch-sdpa" in captured.err  # left out: torch's kernels are timed without modifiers
    rows = json.loads(path.read_text())
    assert {(r["impl"], r["pass_"]) for r in rows} == {
        (i, p) for i in ("numpy", "naive-numpy") for p in ("forward", "backward")}
    pairs = sum(min(i, 7) + 1 for i in range(64))  # query i sees keys i - 7 .. i
    for r in rows:
        assert r["modifiers"] == "window=(7, None) bias=(1, H, S, S)"
        want = 4 * 2 * 16 * pairs * (2.5 if r["pass_"] == "backward" else 1)
        assert r["tflops"] * r["seconds"] * 1e12 == pytest.approx(want)


@pytest.mark.parametrize("text", ["7", "a,3", "1,2,3"])
def test_bench_names_a_bad_window(text, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--window", text])
    assert "--window" in capsys.readouterr().err


def test_naive_baseline_computes_a_window_and_a_bias():
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 9, 2, 4)) for _ in range(4))
    bias = rng.standard_normal((1, 2, 9, 9))
    import reference
    kw = dict(causal=True, window=(3, None), bias=bias)
    fwd, bwd = bench.naive_numpy(q, k, v, dout, True, 0.5, window=(3, None), bias=bias)
    np.testing.assert_allclose(fwd().transpose(0, 2, 1, 3), reference.attention(q, k, v, scale=0.5, **kw), rtol=1e-12)
    got = bwd()
    want = reference.attention_backward(dout, q, k, v, scale=0.5, **kw)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_allclose(g.transpose(0, 2, 1, 3), w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[3], want[3], rtol=1e-10, atol=1e-12)

def test_naive_baseline_computes_attention():
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 9, 2, 4)) for _ in range(4))
    import reference
    for causal in (False, True):
        fwd, bwd = bench.naive_numpy(q, k, v, dout, causal, 0.5)
        np.testing.assert_allclose(fwd().transpose(0, 2, 1, 3),
                                   reference.attention(q, k, v, causal=causal, scale=0.5), rtol=1e-12)
        for got, want in zip(bwd(), reference.attention_backward(dout, q, k, v, causal=causal, scale=0.5)):
            np.testing.assert_allclose(got.transpose(0, 2, 1, 3), want, rtol=1e-10, atol=1e-12)


def test_peak_memory_sees_a_score_sized_allocation():
    if not bench.HostPeak.available:
        pytest.skip("no /proc/self/clear_refs on this system")
    # 64 MiB: past glibc's largest dynamic mmap threshold (32 MiB), so fresh pages whatever the
    # process freed before (a smaller block may reuse resident heap left by earlier tests)
    with bench.HostPeak() as probe:
        a = np.ones(64 * 2**20 // 8)
        del a
    assert 63 * 2**20 <= probe.peak <= 70 * 2**20


def test_the_core_install_brings_threadpoolctl():
    # without it the NumPy backend runs one worker (BLAS threads itself), 2.8x slower on 2 cores
    import importlib.metadata
    core = [r for r in importlib.metadata.requires("flashcupy") if "extra ==" not in r]
    assert any(r.startswith("threadpoolctl") for r in core), core


def test_check_feature_cases_pass_on_the_cupy_backend_on_the_emulator():
    # what `check` runs on a GPU past the battery, here on the CPU CUDA emulator: the tensor-core
    # kernels for float16 (v's head dim padded, the keep mask drawn in the kernels), SIMT for float32
    from flashcupy.tools import check
    from flashcupy.tools.emulator.cupy import emulated

    with emulated():
        rows = list(check.check_rows(check.oracle(), ["cupy"], ("float16", "float32"), battery=()))
    assert len(rows) == 2 * len(check.FEATURE_CASES)
    assert all(row["ok"] for row in rows), [check.format_check_row(row) for row in rows]
