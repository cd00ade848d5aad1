#!/usr/bin/env bash
# The test command: sets up the environment on a fresh machine, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash tools/test.sh tests/unit -k config`).
cd "$(dirname "$0")/.."
source tools/_env.sh
ensure_env
# pytest exits 5 when it collects no test; set -e makes that (and any failure) fail this script.
python -m pytest "$@"
