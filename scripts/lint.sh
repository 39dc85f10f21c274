#!/usr/bin/env bash
# Lint and type checks (configured in pyproject.toml); any error fails. scripts/test.sh runs this
# before the tests. Needs ruff and mypy: pip install -r requirements-dev.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .   # `ruff format .` applies it
"$PYTHON" -m mypy   # which packages and how strictly: [tool.mypy] in pyproject.toml
