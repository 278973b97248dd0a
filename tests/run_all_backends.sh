#!/usr/bin/env bash
# Runs the whole test suite once per Keras backend (jax, tensorflow, torch).
# Extra arguments go to pytest, e.g. `bash tests/run_all_backends.sh -m large`.
set -u
cd "$(dirname "$0")/.."
status=0
for backend in jax tensorflow torch; do
    echo "=== KERAS_BACKEND=$backend ==="
    KERAS_BACKEND=$backend python -m pytest tests -q -n 2 "$@" || status=1
done
exit $status
