#!/bin/bash
# On the CUDA host: keep GGUF part N (carried in .dev/pN) on the warm machine; part 1 also
# installs the gguf wheel and runs the recipe at a tiny scale on CUDA (a smoke test).
S=/root/stage; mkdir -p $S
cp .dev/p$1/part_* $S/ && ls -la $S
if [ "$1" = 1 ]; then
  nvidia-smi -L
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/whl/*.whl \
    || exit 2
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  python3 scripts/gpu_recipe.py --out /tmp/tinyd --target .dev/tiny/tiny-target --device cuda \
    --prompts 3 --max-new-tokens 10 --gen-batch 4 --gen-minutes 2 --train-minutes 0.1 \
    --block-size 4 --layers 1 --draft-vocab 40 --anchors 4 --batch-size 2 \
    --mask-token-id "$(cat .dev/tiny/mask)" \
    2>&1 | tail -8
fi
