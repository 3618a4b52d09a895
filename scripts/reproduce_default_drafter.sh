#!/usr/bin/env bash
# Recipe for the shipped drafter assets/drafters/smollm2-135m-dflash-chat (chat domain only).
# Takes about 1.5–2 hours on 2 CPU cores; every step resumes or is idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-assets/drafters/smollm2-135m-dflash-chat}
MINUTES=${TRAIN_MINUTES:-80}

./dev.sh pull smollm2
./dev.sh regenerate --domain chat --split train --out data/trajectories/chat_train.jsonl
./dev.sh regenerate --domain chat --split eval --out data/trajectories/chat_eval.jsonl
./dev.sh train data/trajectories/chat_train.jsonl --val data/trajectories/chat_eval.jsonl \
  --out "$OUT" --layers 3 --epochs 3 --max-minutes "$MINUTES" --anchors 24 --lr 1e-3 --bf16-autocast \
  --title "SmolLM2-135M-Instruct DFlash drafter (chat only)" --seed 0
.venv/bin/python bench/eval_drafter.py --drafter "$OUT" --prompts 8 --max-new-tokens 64 \
  --out docs/results/default_drafter_eval.json
