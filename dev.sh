#!/usr/bin/env bash
# AdaFlash's one entry point. Creates .venv and installs everything the project needs on first
# use (and again whenever pyproject.toml or this file change), then runs the command:
#
#   ./dev.sh test [pytest args]     the test suite (what .ci/run calls)
#   ./dev.sh <subcommand> [args]    any `adaflash` subcommand, e.g. ./dev.sh generate ...
#
# Environment: ADAFLASH_PYTHON (default python3.11, else python3), ADAFLASH_TORCH (default
# torch==2.13.0; installed before anything else so no other package pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"

PY=${ADAFLASH_PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH=${ADAFLASH_TORCH:-torch==2.13.0}
VENV=.venv
STAMP=$VENV/.adaflash-installed

want=$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
  echo "[dev.sh] creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[dev.sh] installing dependencies into $VENV (first run or changed pyproject.toml)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH"
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  echo "$want" > "$STAMP"
fi

# Browser tests drive Debian's Chromium (Playwright cannot download a browser here).
ensure_chromium() {
  command -v chromium >/dev/null 2>&1 && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[dev.sh] installing Debian's chromium for the browser tests" >&2
    apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  else
    echo "[dev.sh] chromium is missing: install it (apt-get install chromium) or set ADAFLASH_CHROMIUM" >&2
  fi
}

cmd=${1:-help}
shift || true
case "$cmd" in
  test) ensure_chromium; exec "$VENV/bin/python" -m pytest "$@" ;;
  help|-h|--help) exec "$VENV/bin/adaflash" --help ;;
  *) exec "$VENV/bin/adaflash" "$cmd" "$@" ;;
esac
