#!/usr/bin/env bash
# One command for a lent GPU; the stages and the report are described in benchmarks/gpu_session.py.
#     device run:  bash benchmarks/gpu_session.sh             (report in $OUT)
#     here:        bash benchmarks/gpu_session.sh --dry-run   (no GPU: the emulator, tiny shapes)
# Python packages the device image lacks travel as wheels in .whl/ (see the device tool's README)
# and are installed here into a folder of their own, put first on the path of every stage. The
# wheels in .whl/numba/ (FLASHCUPY_NUMBA_WHEELS: a NumPy that numba-cuda works with, put there by
# benchmarks/gpu_wheels.sh) go into another, which gpu_session.py puts first on the path of the
# Numba processes alone (FLASHCUPY_NUMBA_SITE).
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/flashcupy-site
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
numba_wheels=${FLASHCUPY_NUMBA_WHEELS:-.whl/numba}
numba_site=
if compgen -G "$numba_wheels/*.whl" >/dev/null; then
    numba_site=$(mktemp -d "${TMPDIR:-/tmp}/flashcupy-numba-site.XXXXXX")
    if $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$numba_site" \
            "$numba_wheels"/*.whl; then
        export FLASHCUPY_NUMBA_SITE=$numba_site
        echo "gpu_session.sh: the Numba processes import $(ls "$numba_site" | grep -c dist-info) carried wheel(s) from $numba_site"
    else
        echo "gpu_session.sh: the wheels in $numba_wheels did not install; the Numba processes import the image's" >&2
    fi
fi
$py benchmarks/gpu_session.py "$@"
code=$?
[ -n "$numba_site" ] && rm -rf "$numba_site"
exit $code
