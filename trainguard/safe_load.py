"""What a rank's restore loads, and how: weights only unless the node's operator allows pickle.

A planted shard must not run code in the rank that restores it: `torch.load(weights_only=True)` for plain
shards, an allow-list unpickler for DCP's metadata, and the rank helper's own state saved as tensors and plain
values. Standard library and torch only (imported lazily): the rank helper imports this inside the user's
training script.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DCP_DIR = "dcp"
"""The folder of a step that holds its `torch.distributed.checkpoint` files (on a node and in the store):
`dcp/__<rank>_0.distcp` per rank and `dcp/.metadata` from rank 0. The node agent imports the name."""

ENV_ALLOW_PICKLE = "TRAINGUARD_ALLOW_PICKLE"
"""Set (1/true/on) in a node agent's environment, which its ranks inherit, by the node's operator: restores on
that node may unpickle arbitrary objects (`torch.load(weights_only=False)`). Unset, a restore loads only
tensors, dicts, lists, numbers and strings (`weights_only=True`, DCP's metadata through an allow-list), so a
planted shard cannot run code in the rank. A spec cannot set it: `TRAINGUARD_*` names are the agent's."""


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """A shard file's checksum, as its meta file and the manifest hold it (a restore checks it first)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def files_digest(files: list[dict[str, Any]]) -> str:
    """One sha256 standing for a shard made of several files: over each file's name and sha256, in name
    order. The node agent computes the same from the manifest, so a shard's identity is one string."""
    lines = "".join(f"{f['name']} {f['sha256']}\n" for f in sorted(files, key=lambda f: f["name"]))
    return hashlib.sha256(lines.encode()).hexdigest()


Template = dict[str, Any] | Callable[[], dict[str, Any]]
"""What a DCP checkpoint loads into: the state dict, or a function that builds it (called only to restore)."""

TEMPLATE_FIX = ("Pass a function that builds the state dict to load into, called only when there is a checkpoint "
                "to restore: def state(): model_sd, optim_sd = get_state_dict(model, optimizer); return "
                "{'model': model_sd, 'optim': optim_sd}; then restored = run.restore(state).")


def caller_outside(*files: str) -> str:
    """`file:line` of the script's call into the rank helper: the innermost frame outside `files` and here,
    so an error names the user's line, not the helper's."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in (*files, __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _numpy_rng_globals() -> list[Any]:
    """What numpy's RNG state (an ndarray of uint32, saved with every checkpoint's RNG) needs from the
    unpickler beyond weights_only's defaults; none when numpy is not loaded (then no state holds it)."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    return [core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]


def load_weights_only(source: Any, *, allow_pickle: bool = False) -> Any:
    """`torch.load` of a checkpoint file or buffer the way a restore does: weights only (tensors, containers,
    numbers, strings and numpy's RNG state), unless the node's operator allows pickle (`ENV_ALLOW_PICKLE`).
    Anything else raises `pickle.UnpicklingError` naming the global it refused, and nothing of it runs."""
    import torch

    if allow_pickle:
        return torch.load(source, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        return torch.load(source, map_location="cpu", weights_only=True)


def helper_bytes(helper: dict[str, Any]) -> bytes:
    """The helper's own state (step, rank, RNG) as a DCP checkpoint stores it: a `torch.save`, which restores
    weights-only. (Before, a `pickle.dumps`, whose tensors unpickle through torch's unrestricted load.)"""

    import torch

    buffer = io.BytesIO()
    torch.save(helper, buffer)
    return buffer.getvalue()


def helper_from_bytes(data: bytes, allow_pickle: bool) -> dict[str, Any] | None:
    """The helper's state saved with a DCP checkpoint; None (RNG not restored, with a warning) for one in the
    older pickle form on a node that does not allow pickle."""
    import pickle

    if data[:2] == b"PK":  # a torch.save (zip)
        return load_weights_only(io.BytesIO(data), allow_pickle=allow_pickle)
    if allow_pickle:
        return pickle.loads(data)
    print(f"trainguard: this DCP checkpoint keeps its RNG state as a pickle, which is only loaded where the "
          f"node allows it ({ENV_ALLOW_PICKLE}=1): the RNG is not restored", file=sys.stderr, flush=True)
    return None


_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})
"""What a DCP `.metadata` pickle may name besides the classes of DCP's metadata module and torch's dtypes,
layouts and memory formats: it is read with these alone (`pickle.Unpickler.find_class`), so a planted
`.metadata` cannot call anything else."""


def _dcp_metadata_class(module: str, name: str) -> Any:
    """The global `module.name` when a DCP metadata pickle may use it; else UnpicklingError."""
    import importlib

    import torch

    if (module, name) in _DCP_METADATA_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == _DCP_METADATA_MODULE:
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and found.__module__ == module:
            return found  # its dataclasses and enums: built from data, nothing called
    if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"a DCP checkpoint's metadata names {module}.{name}, which a restore does not "
                                 f"load (set {ENV_ALLOW_PICKLE}=1 on the node to trust the checkpoint)")


def safe_dcp(restore_dir: Path, allow_pickle: bool) -> tuple[Any, Any]:
    """DCP's reader and load planner for a restore: its metadata unpickled through `_dcp_metadata_class`, its
    non-tensor values loaded weights-only (DCP itself unpickles both unrestricted)."""

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return _dcp_metadata_class(module, name)

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
                metadata = MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = load_weights_only(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    path = str(restore_dir / DCP_DIR)
    if allow_pickle:
        return dcp.FileSystemReader(path), None
    return Reader(path), Planner()


