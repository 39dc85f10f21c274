"""Ways to damage a file for the readers' fuzz tests: each maps the file's bytes to new bytes."""

import io

import numpy as np


def npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(4))
    return buffer.getvalue()


def flip(data: bytes, at: int) -> bytes:
    """data with the byte at `at` (clamped into the file) inverted."""
    if not data:
        return b"\xff"
    at = min(max(at, 0), len(data) - 1)
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


# name: bytes -> bytes, the mutations every reader is fed
COMMON = {
    "truncated to half": lambda d: d[: len(d) // 2],
    "flipped in the middle": lambda d: flip(d, len(d) // 2),
    "foreign: .npz": lambda d: npz_bytes(),
    "emptied": lambda d: b"",
    "flipped at the start": lambda d: flip(d, 0),
    "truncated by one byte": lambda d: d[:-1],
    "flipped near the end": lambda d: flip(d, len(d) - 9),
    "foreign: random bytes": lambda d: np.random.default_rng(0).bytes(max(len(d), 64)),
}
