"""The filesystem step of configuration: the paths the flags name exist, or can be created.

Kept apart from config_rules (which never reads a file) so that a configuration can be judged
for another machine (--dry-run, a conversion's target layout) and so that each check names its
flag. The data files' contents are checked by data/checks.py.
"""

from __future__ import annotations

import os

from .config import Config
from .data.gpt_dataset import parse_data_path


def path_problems(cfg: Config) -> list[str]:
    """Every path flag that cannot work on this machine, each naming the flag."""
    c, d = cfg.checkpoint, cfg.data
    found = []
    # --load DIR --save DIR (a requeued Slurm job) may name a directory the first run creates
    if c.load is not None and not os.path.isdir(c.load) and c.load != c.save:
        found.append(
            f"--load {c.load}: no such directory; pass the --save directory of an earlier run"
        )
    for name, path in [
        ("--save", c.save),
        ("--tensorboard-dir", cfg.logging.tensorboard_dir),
        ("--data-cache-path", d.data_cache_path),
    ]:
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            found.append(f"{name} {path} exists and is not a directory; choose another path")
    return found + _data_path_problems(d.data_path)


def _data_path_problems(data_path: list[str]) -> list[str]:
    """Every --data-path prefix must have its .bin and .idx."""
    try:
        prefixes, _ = parse_data_path(data_path) if data_path else ([], None)
    except ValueError:
        return []  # config_rules reports the malformed value
    missing = [
        path
        for prefix in prefixes
        for path in (prefix + ".bin", prefix + ".idx")
        if not os.path.isfile(path)
    ]
    if not missing:
        return []
    return [
        "--data-path: missing " + ", ".join(missing) + "; run tools/preprocess_data.py to "
        "create them (the prefix is the path without .bin/.idx, e.g. "
        "data/demo_text_document)"
    ]
