"""Command-line tools; run them from the repository root as `python -m tools.NAME`."""
