"""Shared by the benchmark scripts: the example's GPT, imported from examples/train_gpt.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def load_example() -> Any:
    """examples/train_gpt.py as a module (its ``GPT``), without running it."""
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
