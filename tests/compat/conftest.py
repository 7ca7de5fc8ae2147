"""torch FSDP1 compatibility tests: scenarios of torch's own FSDP1 test files, run against this library.

Structural checks run in the pytest process on a one-rank group (``single_rank_group``); training and
collectives on the shared rank pools (``pool``, from ``tests/conftest.py``).
"""

from __future__ import annotations

from tests.unit.conftest import single_rank_group

__all__ = ["single_rank_group"]
