"""The README's API example runs and prints what the README shows."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_correction_api_example_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "correction_api.py")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "packed layout agrees with padded" in out
    assert "rollout_corr/rollout_is_mean" in out
