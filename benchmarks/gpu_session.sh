#!/usr/bin/env bash
# One command for a lent GPU; the stages and the report are described in benchmarks/gpu_session.py.
#     device run:  bash benchmarks/gpu_session.sh             (report in $OUT)
#     here:        bash benchmarks/gpu_session.sh --dry-run   (no GPU: the emulator, tiny shapes)
# Python packages the device image lacks travel as wheels in .whl/ (see the device tool's README)
# and are installed here into a folder of their own, put first on the path of every stage.
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/flashcupy-site
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec $py benchmarks/gpu_session.py "$@"
