"""FSDP trains exactly like a plain model on the concatenated batch (SGD with momentum, 1e-5)."""

from __future__ import annotations

import pytest

from tests.parity import run_parity
from tests.rank_pool import RankPool

TOL = 1e-5

ALL_CASES = [
    "nested",
    "root_only",
    "tiny",
    "frozen_mixed",
    "called_twice",
    "structured_outputs",
    "tied",
    "buffers",
]


def _parity(case: str, kwargs: dict) -> dict[str, float]:
    return run_parity(case, steps=3, **kwargs)


def _check(results: list[dict[str, float]]) -> None:
    for rank, diffs in enumerate(results):
        for what, value in diffs.items():
            assert value <= TOL, f"rank {rank}: {what} differs by {value:.3g}: {diffs}"


@pytest.mark.parametrize("pool", [1, 2, 3, 4], indirect=True)
@pytest.mark.parametrize("case", ALL_CASES)
def test_parity_default_options(pool: RankPool, case: str) -> None:
    _check(pool.run(_parity, case, {}))


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"flatten_parameters": False},
        {"reshard_after_forward": False},
        {"disable_reshard_on_root": False},
        {"process_group_reduce_scatter": "default"},
        {"gradient_predivide_factor": 1.0},
        # compute stays on the CPU even where CUDA exists (offload alone would pick the GPU)
        {"move_params_to_cpu": True, "compute_device": "cpu"},
        {"cpu_offload": True, "move_grads_to_cpu": True, "compute_device": "cpu"},
    ],
    ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()),
)
@pytest.mark.parametrize("case", ["nested", "tiny", "frozen_mixed", "tied"])
def test_parity_options(pool: RankPool, case: str, kwargs: dict) -> None:
    if kwargs.get("process_group_reduce_scatter") == "default":
        from fsdp import ProcessGroupName

        kwargs = {"process_group_reduce_scatter": ProcessGroupName.default}
    _check(pool.run(_parity, case, kwargs))
