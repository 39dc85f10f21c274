"""Text generation from trained checkpoints."""
