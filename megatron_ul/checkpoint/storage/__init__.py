"""Storage formats of a training checkpoint, one module per `--ckpt-format`."""
