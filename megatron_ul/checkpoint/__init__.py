"""Checkpoints: Megatron's directory layout, crash-safe saves, exact resume, layout conversion
and interop with other frameworks.

    files, safe_pickle, state   shared: paths and durable writes, safe unpickling, named state
    training/                   save and load a run (format-free)
    storage/                    one module per --ckpt-format
    layout/                     TP/PP/VP resharding, ZeRO state in layout-independent form
    interop/                    Hugging Face, Megatron-LM and megatron-core converters
"""
