#!/bin/bash
# On the CUDA host, after stage.sh 1 … N-1, with the last part carried in .dev/pN:
# join the GGUF, check it, rebuild the target, run the recipe inside MINUTES, copy the drafter
# to $OUT (weights in 15 MB pieces: join with cat).   MINUTES=8.5 bash scripts/remote_gpu/main.sh
set -o pipefail
S=/root/stage; G=$S/gguf; T=$S/smollm2-135m-instruct
mkdir -p $S $G $T && cp .dev/p*/part_* $S/ 2>/dev/null
cat $S/part_* > $G/m.gguf
echo "$(cat .dev/gguf.sha256)  $G/m.gguf" | sha256sum -c || exit 4
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .dev/whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
tar xJf .dev/small.tar.xz -C $T
python3 scripts/remote_gpu/convert.py $G/m.gguf $T .dev/manifest.json 2>&1 | grep -v "it/s"
[ -f $T/model.safetensors ] || exit 5
python3 scripts/gpu_recipe.py --out $S/drafter --target $T --minutes ${MINUTES:-8.5} \
  --init assets/drafters/smollm2-135m-dflash --prompts ${PROMPTS:-2000} --gen-minutes 1.5 \
  --anchors 128 --batch-size 16 --curve-every 1000000 2>&1 | grep --line-buffered -v "it/s" \
  | tee $OUT/log.txt
cd $S/drafter && split -b 15M model.safetensors $OUT/model.safetensors.part- \
  && tar cf $OUT/card.tar README.md config.json draft_vocab.json training.json \
  && sha256sum model.safetensors | tee $OUT/sha.txt
