# Sourced by tools/test.sh and tools/demo.sh: creates the project's virtual environment once and
# installs what the project needs. On a machine without torch it installs the CPU wheel
# torch==2.13.0 first (a plain `torch` requirement would pull a multi-GB CUDA build); a torch that
# the machine already has (a GPU machine's CUDA build) is seen through --system-site-packages and
# never replaced.
set -euo pipefail
RLCORR_VENV=${RLCORR_VENV:-.venv}
ensure_env() {
  if [ ! -x "$RLCORR_VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$RLCORR_VENV"
  fi
  local py="$RLCORR_VENV/bin/python"
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "[env] installing torch==2.13.0 (CPU build)"
    "$py" -m pip install -q --disable-pip-version-check torch==2.13.0
  fi
  local stamp="$RLCORR_VENV/.rlcorr-installed"
  local want
  want=$(cat setup.py | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[env] installing megatron-rlcorr and its test tools into $RLCORR_VENV"
    "$py" -m pip install -q --disable-pip-version-check -e ".[dev]"
    echo "$want" > "$stamp"
  fi
  export PATH="$PWD/$RLCORR_VENV/bin:$PATH"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}
