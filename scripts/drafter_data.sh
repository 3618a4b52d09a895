#!/usr/bin/env bash
# The drafter-data job (issue: a drafter that generalises): the held-out self-written set
# (namespace 1, Magpie only), then the training shards (namespace 0), into assets/drafter_data/.
# One torch thread, resumable: rerun it and it goes on where it stopped.
#
#   nohup scripts/drafter_data.sh > data/logs/drafter_data.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
./dev.sh drafter-data --seed 1 --shards 1 --prompts-per-shard 384 --magpie-only --threads 1
./dev.sh drafter-data --seed 0 --shards "${SHARDS:-100}" --threads 1
