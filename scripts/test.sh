#!/usr/bin/env bash
# Install what the tests need and run the default suite (under 10 minutes on 2 CPU cores).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh --run-slow` for the long matrices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
exec "${PYTHON:-python3}" -m pytest -q "$@"
