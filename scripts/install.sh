#!/usr/bin/env bash
# Install megatron_ul and its dependencies into the current Python.
#   bash scripts/install.sh              runtime dependencies, tokenizers, `pip install -e .`
#   bash scripts/install.sh --dev        plus the test, lint and Hugging Face dependencies
#   bash scripts/install.sh --deps-only  (with or without --dev) dependencies only, not the
#                                        package: the tests import it from the checkout
# The lists are the requirements*.txt files (pyproject.toml reads them for its extras).
# Without a GPU it installs the CPU build of torch (pin torch==2.13.0); a bare "torch" requirement
# would pull a multi-GB CUDA build. Override with TORCH_SPEC="torch==X.Y.Z" (and pip's own
# --index-url / PIP_INDEX_URL for PyTorch's CPU wheel index on machines that need it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dev=0 package=1
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --deps-only) package=0 ;;
    *) echo "install.sh: unknown option $arg (use --dev, --deps-only)" >&2; exit 2 ;;
  esac
done

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-torch}
  else
    spec=${TORCH_SPEC:-torch==2.13.0}
  fi
  echo "installing $spec"
  "$PYTHON" -m pip install -q "$spec"
fi
"$PYTHON" -m pip install -q -r requirements.txt -r requirements-data.txt
if [[ $dev == 1 ]]; then
  "$PYTHON" -m pip install -q -r requirements-hf.txt -r requirements-dev.txt
fi
if [[ $package == 1 ]]; then
  "$PYTHON" -m pip install -q --no-deps -e .
fi
"$PYTHON" - <<'PY'
import torch
print(f"torch {torch.__version__} ready ({'CUDA' if torch.cuda.is_available() else 'CPU'})")
PY
