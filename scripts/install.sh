#!/usr/bin/env bash
# Install megatron_ul's dependencies into the current Python.
#   bash scripts/install.sh          runtime dependencies
#   bash scripts/install.sh --dev    plus the test dependencies
# Without a GPU it installs the CPU build of torch (pin torch==2.13.0); a bare "torch" requirement
# would pull a multi-GB CUDA build. Override with TORCH_SPEC="torch==X.Y.Z" (and pip's own
# --index-url / PIP_INDEX_URL for PyTorch's CPU wheel index on machines that need it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
  else
    spec=${TORCH_SPEC:-torch==2.13.0}
  fi
  echo "installing $spec"
  "$PYTHON" -m pip install -q "$spec"
fi
"$PYTHON" -m pip install -q -r requirements.txt
if [[ "${1:-}" == "--dev" ]]; then
  "$PYTHON" -m pip install -q -r requirements-dev.txt
fi
"$PYTHON" - <<'PY'
import torch
print(f"torch {torch.__version__} ready ({'CUDA' if torch.cuda.is_available() else 'CPU'})")
PY
