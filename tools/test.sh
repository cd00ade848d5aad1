#!/usr/bin/env bash
# The test command: sets up the environment on a fresh machine, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash tools/test.sh tests/unit -k config`).
# `--quick` (first argument): the inner loop, `-m "not slow"`: every module's unit tests and one
# distributed test per parallel family, without the tests measured slow (tests/tiers.py).
# `--mcore-latest` (first argument) builds and tests the second environment instead:
# .venv-mcore-latest, Python 3.12 with the newest megatron-core under setup.py's cap
# (tools/_env.sh), e.g. `bash tools/test.sh --mcore-latest tests/distributed -k memory`.
cd "$(dirname "$0")/.."
quick=()
case "${1:-}" in
  --mcore-latest) shift; export RLCORR_MCORE_LATEST=1 ;;
  --quick) shift; quick=(-m "not slow") ;;
esac
source tools/_env.sh
ensure_env
# pytest exits 5 when it collects no test; set -e makes that (and any failure) fail this script.
python -m pytest "${quick[@]}" "$@"
