#!/bin/bash
# Prepares data but launches nothing (a test fixture).
set -x
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
python3 examples/data_preprocess/gsm8k.py --local_dir "$DATA_DIR"
echo "data ready in $DATA_DIR"
