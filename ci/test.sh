#!/usr/bin/env bash
# The project's test command (README "Test"; .ci/run calls it): unit tests, then the conformance
# suite against every backend this machine can run. On a machine without a GPU that is cpu,
# cpu_amx (which reports the cpu row when the CPU has no AMX) and metax (EMULATED).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pytest -q tests "$@"
for backend in ${FDX_BACKENDS:-cpu cpu_amx metax}; do
  echo "=== conformance: $backend"
  $PY -m pytest -q -p no:cacheprovider --pyargs fastdeploy_ext.conformance --fdx-backend "$backend" "$@"
done
# the suite needs no transformers: every test runs against the shipped references (a skip fails)
echo "=== conformance: cpu, transformers blocked from import"
PYTHONPATH="ci${PYTHONPATH:+:$PYTHONPATH}" $PY -m pytest -q -p no:cacheprovider -p no_transformers \
  --pyargs fastdeploy_ext.conformance --fdx-backend cpu "$@"
