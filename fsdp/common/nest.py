"""Walking nests of tuples, lists, dicts, namedtuples and dataclasses (module outputs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["visit_tensors"]


def visit_tensors(obj: Any, fn: Callable[[torch.Tensor], None], opaque: list[Any]) -> None:
    """Call ``fn`` on every tensor in a nest of tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            visit_tensors(v, fn, opaque)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            visit_tensors(v, fn, opaque)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            visit_tensors(getattr(obj, f.name), fn, opaque)
    elif obj is not None and not isinstance(obj, (int, float, bool, str, bytes, complex)):
        opaque.append(obj)
