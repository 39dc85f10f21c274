"""Reads a W&B offline run file (run-*.wandb) back: its run record (project, name, config) and
its history rows, for the tests of --wandb-project.

The file is a LevelDB-style log (the format wandb writes and `wandb sync` reads): a 7-byte file
header (":W&B", 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
(checksum u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) whose payloads join into
protobuf `Record`s (wandb/proto/wandb_internal.proto). wandb 0.31 ships no Python reader.
"""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32 * 1024
HEADER = 7


def _payloads(raw: bytes):
    if raw[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    position, pending = HEADER, b""
    while position + HEADER <= len(raw):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        payload = raw[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb 0.31 writes nested_key


def read_offline_run(save_dir: str) -> dict:
    """{"project", "name", "config": {key: value}, "history": {step: {tag: value}}} of the one
    offline run under save_dir/wandb."""
    from wandb.proto import wandb_internal_pb2

    files = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {save_dir}, found {files}"
    with open(files[0], "rb") as f:
        raw = f.read()
    out: dict = {"history": {}}
    for payload in _payloads(raw):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["project"], out["name"] = record.run.project, record.run.display_name
            out["config"] = {_key(i): json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            step = int(row.pop("_step", record.history.step.num))
            values = {k: v for k, v in row.items() if not k.startswith("_")}
            out["history"].setdefault(step, {}).update(values)
    return out
