#!/usr/bin/env bash
# One device call for the Hopper kernels after a change (the session's own figures come from
# gpu_session.sh): the GPU building blocks and the CuPy battery against the float64 oracle, the forward's
# and backward's side-by-side timings, and Nsight Compute's summary of the backward's dK/dV kernel where
# ncu exists. Reports into $OUT (default benchmarks/results/gpu).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
python3 -m pytest -o addopts= -m gpu -q -p no:cacheprovider tests/test_hopper_gpu.py tests/test_cupy_gpu.py 2>&1 \
    | tail -15 > "$out/tests.txt"
tail -3 "$out/tests.txt"
if [ "${FORWARD:-1}" = 1 ]; then
    timeout 150 python3 benchmarks/hopper_forward_check.py > "$out/forward.txt" 2>&1; tail -24 "$out/forward.txt"
fi
if [ "${BACKWARD:-1}" = 1 ]; then
    timeout 240 python3 benchmarks/hopper_backward_check.py > "$out/backward.txt" 2>&1; tail -27 "$out/backward.txt"
fi
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -n "$ncu" ] && [ "${NCU:-1}" = 1 ]; then
    cat > /tmp/ncu_case.py <<'PY'
import sys, cupy, flashcupy
S, causal = int(sys.argv[1]), sys.argv[2] == "1"
q, k, v, do = (cupy.random.standard_normal((1, S, 16, 128), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
out, lse = flashcupy.attention(q, k, v, causal=causal, return_lse=True)
flashcupy.attention_backward(do, q, k, v, out, lse, causal=causal)
cupy.cuda.get_current_stream().synchronize()
PY
    for causal in 0 1; do
        timeout 120 "$ncu" -k regex:flash_bwd_dkdv_sm90 -c 1 --section SpeedOfLight --section WarpStateStats \
            --section Occupancy python3 /tmp/ncu_case.py 4096 $causal > "$out/ncu_bwd_causal$causal.txt" 2>&1
        grep -E "Duration|Throughput|Stall|Warp Cycles|Issued" "$out/ncu_bwd_causal$causal.txt" | head -20
        # where the causal kernel's extra time per pass goes (the fit of the H200 figures: ~320 TFLOP/s a pass
        # against ~463 without the mask, at every length): every raw metric of the warp-state and source
        # sections (the stall reasons, smsp__average_warp_latency_issue_stalled_*), then the stall samples per
        # SASS instruction
        timeout 120 "$ncu" -k regex:flash_bwd_dkdv_sm90 -c 1 --section WarpStateStats --section SourceCounters \
            --page raw --csv python3 /tmp/ncu_case.py 4096 $causal > "$out/ncu_bwd_causal${causal}_raw.csv" 2>&1
        tr ',' '\n' < "$out/ncu_bwd_causal${causal}_raw.csv" | grep -c stalled
        timeout 120 "$ncu" -k regex:flash_bwd_dkdv_sm90 -c 1 --section SourceCounters --page source --print-source sass \
            --csv python3 /tmp/ncu_case.py 4096 $causal > "$out/ncu_bwd_causal${causal}_sass.csv" 2>&1
        wc -l < "$out/ncu_bwd_causal${causal}_sass.csv"
    done
fi
