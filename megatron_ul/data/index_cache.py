"""The on-disk cache of dataset indices (.npy files), shared by all ranks.

A set of indices is named by a hash of a JSON description of everything it
depends on (the caller includes the .idx fingerprint, split range, sample
count, sequence length, seed, ...), so a changed input gets a new name instead
of a stale hit. The description is written last, with each array's shape and
dtype, as the completion marker.

Loading checks the marker, every file's shape, dtype and SHA-256 and the
caller's semantic checks (``validate``); a partial, truncated or corrupt set is reported
by file name and rebuilt. One process builds (rank 0 of torch.distributed when
initialised, else the process whose ``RANK`` is 0 or unset), writing through
temporary names; the others wait (barrier, or polling for the marker with a
timeout) and memory-map. A read-only cache is read; when it needs a build it
cannot take, every process builds the (deterministic) indices in memory.
"""

import hashlib
import json
import logging
import os
import time

import numpy as np

log = logging.getLogger("megatron_ul")

CACHE_FORMAT = 2  # bump when the indices' meaning changes
CACHE_WAIT_TIMEOUT_S = 1800.0


class IndexCacheError(RuntimeError):
    """A cached index set that cannot be used; the message names the file."""


def _distributed_rank():
    """This process's torch.distributed rank, or None when not initialised."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def _digest(array: np.ndarray) -> str:
    """SHA-256 of the array's bytes (C order), read in blocks of a memory map."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    digest = hashlib.sha256()
    for start in range(0, flat.size, 1 << 26):
        digest.update(flat[start : start + (1 << 26)].tobytes())
    return digest.hexdigest()


class IndexCache:
    """Builds a set of named arrays once and shares them through .npy files."""

    def __init__(self, cache_dir, description: dict, label: str):
        self.cache_dir = cache_dir
        description = dict(description, cache_format=CACHE_FORMAT)
        self.key_text = json.dumps(description, sort_keys=True, indent=2)
        digest = hashlib.sha256(self.key_text.encode("utf-8")).hexdigest()[:24]
        self.stem = f"{digest}-{label}"

    def path(self, name):
        return os.path.join(self.cache_dir, f"{self.stem}-{name}.npy")

    @property
    def marker_path(self):
        return os.path.join(self.cache_dir, f"{self.stem}-description.json")

    def load_or_build(self, names, build_fn, validate=None) -> dict:
        """The arrays ``names``: from the cache when valid, else built by ``build_fn``
        (and cached by the builder). ``validate(arrays)`` raises ValueError on bad contents."""
        if self.cache_dir is None:
            return build_fn()
        rank = _distributed_rank()
        builder = (rank == 0) if rank is not None else int(os.environ.get("RANK", "0")) == 0
        built = None
        if builder:
            built = self._load_or_build_here(names, build_fn, validate)
        if rank is not None:
            # Every rank reaches the barrier, whether or not it saw the files,
            # so ranks can never disagree on the number of collective calls.
            import torch.distributed

            torch.distributed.barrier()
        elif not builder:
            self._wait_for_marker()
        if built is not None:
            return built
        try:
            return self._load(names, validate)
        except IndexCacheError as error:
            # e.g. no shared file system between nodes, or a read-only cache the builder could
            # not fill
            log.warning("%s; building the indices in memory on this rank", error)
            return build_fn()

    def _load_or_build_here(self, names, build_fn, validate):
        if os.path.isfile(self.marker_path) or any(
            os.path.exists(self.path(name)) for name in names
        ):
            try:
                return self._load(names, validate)
            except IndexCacheError as error:
                log.warning("index cache: %s; rebuilding", error)
        arrays = build_fn()
        try:
            self._write(arrays)
        except OSError as error:
            log.warning(
                "index cache %s not writable (%s); indices kept in memory", self.cache_dir, error
            )
            return arrays
        return self._load(names, validate)

    def _load(self, names, validate) -> dict:
        if not os.path.isfile(self.marker_path):
            raise IndexCacheError(f"{self.marker_path}: missing (incomplete index cache)")
        try:
            with open(self.marker_path, encoding="utf-8") as handle:
                marker = json.load(handle)
        except (OSError, ValueError) as error:
            raise IndexCacheError(f"{self.marker_path}: unreadable or corrupt ({error})") from error
        if marker.get("key") != self.key_text:
            raise IndexCacheError(
                f"{self.marker_path}: describes other indices (hash collision or edited file)"
            )
        arrays = {}
        for name in names:
            path = self.path(name)
            expected = marker.get("arrays", {}).get(name)
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            # numpy raises EOFError (empty file), zipfile's BadZipFile (a "PK" file), ...
            except Exception as error:
                raise IndexCacheError(
                    f"{path}: missing, truncated or corrupt ({type(error).__name__}: {error})"
                ) from error
            if not isinstance(array, np.ndarray):  # np.load opens an .npz archive as NpzFile
                close = getattr(array, "close", None)
                if close is not None:
                    close()
                raise IndexCacheError(
                    f"{path}: a {type(array).__name__}, not one .npy array (another format "
                    f"under a cached index's name)"
                )
            if (
                expected is None
                or list(array.shape) != expected["shape"]
                or str(array.dtype) != expected["dtype"]
            ):
                raise IndexCacheError(
                    f"{path}: shape {array.shape} / dtype {array.dtype} do not match "
                    f"{self.marker_path} ({expected})"
                )
            # Markers written before checksums were recorded carry none: not compared.
            if "sha256" in expected and _digest(array) != expected["sha256"]:
                raise IndexCacheError(
                    f"{path}: corrupt (its SHA-256 differs from the one {self.marker_path} records)"
                )
            arrays[name] = array
        if validate is not None:
            try:
                validate(arrays)
            except ValueError as error:
                raise IndexCacheError(
                    f"{self.cache_dir}/{self.stem}-*.npy: corrupt indices ({error})"
                ) from error
        return arrays

    def _write(self, arrays: dict) -> None:
        os.makedirs(self.cache_dir, exist_ok=True)
        temporaries = []
        try:
            for name, array in arrays.items():
                temporary = self.path(name) + f".tmp-{os.getpid()}.npy"
                temporaries.append(temporary)
                np.save(temporary, np.asarray(array), allow_pickle=False)
            for name in arrays:
                os.replace(self.path(name) + f".tmp-{os.getpid()}.npy", self.path(name))
            marker = {
                "key": self.key_text,
                "arrays": {
                    name: {
                        "shape": list(np.shape(array)),
                        "dtype": str(np.asarray(array).dtype),
                        "sha256": _digest(np.asarray(array)),
                    }
                    for name, array in arrays.items()
                },
            }
            temporary = self.marker_path + f".tmp-{os.getpid()}"
            temporaries.append(temporary)
            with open(temporary, "w", encoding="utf-8") as handle:
                json.dump(marker, handle, indent=1)
            os.replace(temporary, self.marker_path)
        finally:
            for temporary in temporaries:
                if os.path.exists(temporary):
                    os.remove(temporary)

    def _wait_for_marker(self) -> None:
        deadline = time.time() + CACHE_WAIT_TIMEOUT_S
        while not os.path.isfile(self.marker_path):
            if time.time() > deadline:
                raise TimeoutError(
                    f"{self.marker_path}: not written by rank 0 within {CACHE_WAIT_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.5)
