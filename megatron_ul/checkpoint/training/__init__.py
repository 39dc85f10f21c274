"""Training checkpoints: save and load a run, whatever storage format and layout (the format is
looked up in checkpoint/storage, resharding in checkpoint/layout), and what a resume does with
each setting that differs."""
