#!/usr/bin/env bash
# Everything a lent GPU is for, in one command that fits one `device` run (10 minutes):
#   1. the environment (nvidia-smi, `python -m flashcupy info`);
#   2. the GPU-marked tests: the CuPy and Numba batteries on the device;
#   3. compute-sanitizer memcheck and racecheck over a small `check` (when the tool is there);
#   4. `python -m flashcupy bench --gpu-report`: every kernel path against the oracle, then
#      timings against torch SDPA's flash and cuDNN backends.
# Writes at most 7 files into $OUT (the device tool's folder) or benchmarks/results/gpu;
# commit them under benchmarks/results/ with the GPU's name.
#     device run:  bash benchmarks/gpu_session.sh
set -u
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

stamp "environment"
{ nvidia-smi; $py -m flashcupy info; $py -m pip list 2>/dev/null | grep -i -E "cupy|numba|torch|numpy|nvidia"; } \
    > "$out/info.txt" 2>&1

stamp "GPU tests"
timeout 150 $py -m pytest -m gpu -q -p no:cacheprovider tests/test_cupy_gpu.py tests/test_numba_backend.py \
    > "$out/pytest_gpu.txt" 2>&1
tail -n 3 "$out/pytest_gpu.txt"

if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        stamp "compute-sanitizer $tool"
        timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
            $py -m flashcupy check --backend cupy --cases 3 --dtype float16 --dtype float32 \
            > "$out/sanitizer_$tool.txt" 2>&1
        echo "exit $?" >> "$out/sanitizer_$tool.txt"
        tail -n 2 "$out/sanitizer_$tool.txt"
    done
fi

stamp "GPU report"
$py -m flashcupy bench --gpu-report "$out" --report-budget "${REPORT_BUDGET:-240}"
stamp "done"
