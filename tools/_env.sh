# Sourced by tools/test.sh and tools/demo.sh: creates the project's virtual environment once and
# installs what the project needs. On a machine without torch it installs the CPU wheel
# torch==2.13.0 first (a plain `torch` requirement would pull a multi-GB CUDA build); a torch that
# the machine already has (a GPU machine's CUDA build) is seen through --system-site-packages and
# never replaced.
#
# RLCORR_MCORE_LATEST=1 (`bash tools/test.sh --mcore-latest`) builds the second environment
# instead: .venv-mcore-latest on Python 3.12 (what GPU users' NGC containers run) with the newest
# megatron-core that setup.py admits. Megatron-Core >= 0.17 requires Python >= 3.12, so the
# default .venv (this machine's python3, 3.11) resolves to 0.16.1. torch==2.13.0 comes from the
# registry there (on Python 3.12 a CUDA build, ~4.7 GB, which brings the triton that
# `import megatron.core` needs from 0.19 on). RLCORR_PYTHON names the interpreter that creates it
# (default: python3.12 on PATH, else pyenv's 3.12); RLCORR_VENV the directory, in either mode.
set -euo pipefail
RLCORR_MCORE_LATEST=${RLCORR_MCORE_LATEST:-0}
if [ "$RLCORR_MCORE_LATEST" = 1 ]; then
  RLCORR_VENV=${RLCORR_VENV:-.venv-mcore-latest}
  RLCORR_PYTHON=${RLCORR_PYTHON:-}
else
  RLCORR_VENV=${RLCORR_VENV:-.venv}
  RLCORR_PYTHON=${RLCORR_PYTHON:-python3}
fi

# The megatron-core requirement exactly as setup.py states it (e.g. megatron-core>=0.16.1,<0.20).
mcore_requirement() {
  sed -n 's/^[[:space:]]*"\(megatron-core[^"]*\)".*/\1/p' setup.py | head -n 1
}

# A Python 3.12 that runs: python3.12 on PATH, else one that pyenv has installed but not activated
# (its shim then refuses to run).
find_python312() {
  local candidate
  for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

ensure_env() {
  if [ ! -x "$RLCORR_VENV/bin/python" ]; then
    if [ -z "$RLCORR_PYTHON" ]; then
      RLCORR_PYTHON=$(find_python312) || {
        echo "[env] --mcore-latest needs Python 3.12 (megatron-core >= 0.17 requires it): install it, or set" \
             "RLCORR_PYTHON to a Python 3.12 interpreter" >&2
        return 1; }
    fi
    "$RLCORR_PYTHON" -m venv --system-site-packages "$RLCORR_VENV"
  fi
  local py="$RLCORR_VENV/bin/python"
  # Whether torch is installed, without importing it (an import costs seconds on every test run).
  if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
    if [ "$RLCORR_MCORE_LATEST" = 1 ]; then
      echo "[env] installing torch==2.13.0 from the registry into $RLCORR_VENV (on Python 3.12 a CUDA build, ~4.7 GB)"
    else
      echo "[env] installing torch==2.13.0 (CPU build)"
    fi
    "$py" -m pip install -q --disable-pip-version-check torch==2.13.0
  fi
  local stamp="$RLCORR_VENV/.rlcorr-installed"
  local want
  want=$(cat setup.py | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[env] installing megatron-rlcorr and its test tools into $RLCORR_VENV"
    # pip keeps the torch that is here (the machine's own build) or fails: it never replaces it. The
    # version is the installed distribution's (torch.__version__ may add a local label, +cu130, that
    # the registry's wheel metadata does not have, and pip would then find no torch that matches).
    local -x PIP_CONSTRAINT="$RLCORR_VENV/torch-constraint.txt"
    "$py" -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$PIP_CONSTRAINT"
    local req
    req=$(mcore_requirement)
    [ -n "$req" ] || { echo "[env] no megatron-core requirement found in setup.py" >&2; return 1; }
    local pip=("$py" -m pip install -q --disable-pip-version-check)
    if "$py" tools/_requirements.py --torch-is-prerelease 2>/dev/null; then
      # A pre-release torch (NGC's 2.6.0a0+nv...) fails megatron-core's own torch>=2.6.0 under PEP 440:
      # the project and megatron-core go in without their dependencies, then what else they require.
      echo "[env] torch $("$py" -c 'import torch; print(torch.__version__)') is a pre-release build: kept," \
           "megatron-core installed beside it without its torch requirement"
      "${pip[@]}" --no-deps -e ".[dev]" "$req"
      # shellcheck disable=SC2046  # one requirement a line, none with spaces
      "${pip[@]}" $("$py" tools/_requirements.py megatron-rlcorr dev) $("$py" tools/_requirements.py megatron-core)
    elif [ "$RLCORR_MCORE_LATEST" = 1 ]; then
      # Naming megatron-core with -U moves it to the newest release under setup.py's cap, also in
      # an environment built before that release; its dependencies move only if they must.
      "${pip[@]}" -U "$req" -e ".[dev]"
    else
      "${pip[@]}" -e ".[dev]"
    fi
    # Its import prints notices (no Transformer Engine / Apex on a CPU machine): shown only on failure.
    local check
    check=$("$py" -c "import megatron.core" 2>&1) || {
      echo "$check" >&2; echo "[env] import megatron.core fails in $RLCORR_VENV (above)" >&2; return 1; }
    echo "$want" > "$stamp"
  fi
  export PATH="$(cd "$RLCORR_VENV" && pwd)/bin:$PATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}
