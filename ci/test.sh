#!/usr/bin/env bash
# The project's test command (README "Setup and test"; .ci/run calls it): the CI legs of the
# per-device matrix (ci/matrix.yaml) through ci/run_matrix.py — unit tests, the conformance suite
# for every backend this machine can run (cpu, cpu_amx where the CPU has AMX, metax EMULATED),
# the suite with transformers blocked, end-to-end `encode` smokes, Paddle interop and the sample
# out-of-tree backend. Prints a table (leg, result, seconds), writes JUnit XML per leg under
# ci/junit/, exits non-zero if any leg fails. Two legs run at a time (--jobs N to change). Arguments go to run_matrix.py (e.g. --legs 'cpu/*').
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" ci/run_matrix.py "$@"
