"""Setup, the training step and loop, metrics, timers, exit handling, memory estimates."""
