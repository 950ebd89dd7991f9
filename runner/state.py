"""Turning a nested training state into (skeleton, tensors) and back.

A checkpoint holds tensors as raw bytes in shard files, and everything else (the
nesting, Python numbers, strings, RNG tuples) as a small skeleton saved with
``torch.save`` and loaded with ``weights_only=True``, so loading never runs pickled code.
Tensors in the skeleton are replaced by ``{"__tensor__": index}``.
"""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_NDARRAY = "__ndarray__"


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the shard files."""

    #: Shard file name.
    shard: str
    #: Byte offset of the tensor in that shard.
    offset: int
    #: Size in bytes.
    nbytes: int
    #: ``str(torch.dtype)`` without the "torch." prefix.
    dtype: str
    #: Shape.
    shape: tuple[int, ...]


def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a nested state into a tensor-free skeleton and its tensors, in order."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return {_TUPLE: [walk(v) for v in obj]}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            tensors.append(torch.from_numpy(obj.copy()))
            return {_NDARRAY: len(tensors) - 1}
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return obj
        raise TypeError(
            f"cannot checkpoint a {type(obj).__name__}: keep state_dict() values to tensors, "
            "numbers, strings, lists, tuples and dicts"
        )

    return walk(state), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and _TENSOR in obj:
                return tensors[obj[_TENSOR]]
            if len(obj) == 1 and _NDARRAY in obj:
                return tensors[obj[_NDARRAY]].numpy()
            if len(obj) == 1 and _TUPLE in obj:
                return tuple(walk(v) for v in obj[_TUPLE])
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(skeleton)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (0-d tensors included)."""
    return t.reshape(-1).view(torch.uint8)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def capture_rng() -> dict[str, Any]:
    """Every RNG the training loop may draw from.

    numpy's global generator only once ``numpy.random`` has been imported: nothing can have
    drawn from it before, and importing it (numpy 2 does so lazily) would cost every save's
    stall and every restore some 20 ms for a loop that never uses it.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        state["numpy"] = np_random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_digest(state: Any) -> str:
    """sha256 over a state's skeleton and every tensor's bytes: equal iff bit-identical."""
    skeleton, tensors = flatten(state)
    h = hashlib.sha256(repr(skeleton).encode())
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(as_bytes(t).numpy().data)
    return h.hexdigest()
