"""The digest of a model's state that says whether two runs trained identically, and how to tell sharded
tensors (FSDP2, tensor parallel) apart without importing torch.distributed eagerly."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any


def _is_dtensor(value: Any) -> bool:
    """A `torch.distributed.tensor.DTensor` (FSDP2, tensor parallel), told without importing it eagerly."""
    return type(value).__name__ == "DTensor" and hasattr(value, "full_tensor")


def is_sharded(value: Any) -> bool:
    """One rank's part of a larger tensor: a DTensor (FSDP2, tensor parallel) or a ShardedTensor (FSDP1's
    sharded state dict). A `torch.save` of these loads only onto the world size that wrote it."""
    return _is_dtensor(value) or type(value).__name__ == "ShardedTensor"


def holds_tensor(value: Any, kind: Callable[[Any], bool]) -> bool:
    """Whether `value` (nested dicts, lists, tuples) holds a leaf `kind` says yes to."""
    if isinstance(value, dict):
        return any(holds_tensor(item, kind) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(item, kind) for item in value)
    return kind(value)


def holds_dtensor(value: Any) -> bool:
    return holds_tensor(value, _is_dtensor)


def state_digest(module_or_state: Any) -> str:
    """sha256 over parameter names and raw bytes, in name order: equal only for bit-identical states.

    Sharded tensors (DTensor: FSDP2, tensor parallel) are gathered whole first (`full_tensor()`, a
    collective: call it on every rank), and a DDP wrapper's `module.` prefix is dropped, so the same full
    model gives the same digest whatever the world size. Never raises: a digest that cannot be computed
    comes back as `unavailable: <why>`, which the run reports in its result instead of failing after the
    last step."""
    try:
        import torch

        state = module_or_state.state_dict() if hasattr(module_or_state, "state_dict") else module_or_state
        digest = hashlib.sha256()
        for name in sorted(state, key=lambda n: n.removeprefix("module.")):
            tensor = state[name]
            if _is_dtensor(tensor):
                tensor = tensor.full_tensor()
            if not isinstance(tensor, torch.Tensor):
                continue
            digest.update(name.removeprefix("module.").encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()
    except Exception as error:  # noqa: BLE001 - a digest is a report; it must never fail a finished run
        return f"unavailable: {type(error).__name__}: {error}"[:500]
