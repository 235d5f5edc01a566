#!/usr/bin/env bash
# The wheels the GPU session carries to the device machine, which reaches no package index: run this
# here, then name .whl in the device call's carry (benchmarks/results/h200/README.md says how).
#     .whl/numba/  NumPy for the session's Numba processes alone (gpu_session.sh): the device image's
#                  numpy 2.5.2 breaks numba-cuda 0.30.4 at its first compile (np.row_stack, removed in
#                  2.5); 2.4.6 is the NumPy CI runs numba-cuda 0.30.4 with. NUMBA_NUMPY picks another.
#     .whl/*.whl   Dask and the two of its needs the device image lacks (KINDS.md's list has click,
#                  cloudpickle, fsspec, packaging, pyyaml and toolz), for tests/test_cupy_gpu.py's
#                  flashcupy.dask test: pure Python, CI's versions.
# For the device's Python (DEVICE_PYTHON, 3.12 on the H200 image) and x86-64 Linux, whatever runs this.
set -eu
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
rm -rf .whl/numba  # one version of each package: two stop the whole install
$py -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl/numba "numpy==${NUMBA_NUMPY:-2.4.6}"
ls -l .whl/numba
rm -f .whl/dask-*.whl .whl/partd-*.whl .whl/locket-*.whl
$py -m pip download -q --no-deps --only-binary=:all: -d .whl "dask==${DASK_VERSION:-2026.8.0}" partd==1.4.2 locket==1.0.0
ls -l .whl/*.whl
