#!/usr/bin/env bash
# The test command: sets up the environment on a fresh machine, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash tools/test.sh tests/unit -k config`).
# `--quick` (first argument): the inner loop, `-m "not slow"`: every module's unit tests and one
# distributed test per parallel family, without the tests measured slow (tests/tiers.py).
# `--mcore-latest` (first argument) builds and tests the second environment instead:
# .venv-mcore-latest, Python 3.12 with the newest megatron-core under setup.py's cap
# (tools/_env.sh), e.g. `bash tools/test.sh --mcore-latest tests/distributed -k memory`.
# The tests run on RLCORR_TEST_WORKERS pytest-xdist worker processes (default: 2, or 0 on a one-core
# machine and for --quick; 0 runs them in pytest's own process), a test file at a time (--dist loadfile: a file's
# module fixtures are built once, by its worker; session fixtures once per run, tests/session_once.py).
# On the 2-core machine one worker's subprocesses and single-threaded tests fill the core the other
# leaves idle. A `-n`/`--numprocesses` of your own, or `-p no:xdist`, is used as given.
cd "$(dirname "$0")/.."
quick=()
default_workers=$(( $(nproc) >= 2 ? 2 : 0 ))
case "${1:-}" in
  --mcore-latest) shift; export RLCORR_MCORE_LATEST=1 ;;
  --quick) shift; quick=(-m "not slow"); default_workers=0 ;;  # measured faster in one process (docs/testing.md)
esac
source tools/_env.sh
ensure_env
workers=()
if [[ " $* " != *" -n"* && " $* " != *" --numprocesses"* && " $* " != *"no:xdist"* ]]; then
  n=${RLCORR_TEST_WORKERS:-$default_workers}
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "RLCORR_TEST_WORKERS must be a number of worker processes (0: none), got '$n'" >&2; exit 2; }
  (( n > 0 )) && workers=(-n "$n" --dist loadfile)
fi
# pytest exits 5 when it collects no test; set -e makes that (and any failure) fail this script.
python -m pytest "${workers[@]}" "${quick[@]}" "$@"
