#!/usr/bin/env bash
# Install what the tests need, run the linter and type checker (scripts/lint.sh), then the default
# suite (about 7 minutes on 2 CPU cores; the budget is 15). Any lint, type or test error fails.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh --run-slow` for the long matrices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev --deps-only
bash scripts/lint.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
