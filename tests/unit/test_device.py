"""Defaults that depend on the device: the compute device (where the parameters are, fairscale's
CUDA default under offload) and forward prefetch.

CUDA is simulated where the choice depends on it (``torch.cuda.is_available`` and
``current_device`` patched): the rule is host logic, and the machine running the suite may have no
GPU. No tensor is ever put on the simulated device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp._device import DeviceHandle, default_compute_device
from fsdp.api import ScheduleConfig
from fsdp.schedule import Scheduler
from fsdp.topology import backend_is_cuda_only

CPU = torch.device("cpu")
CUDA1 = torch.device("cuda", 1)


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_without_cuda_everything_computes_on_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    assert default_compute_device({CPU}) == CPU
    assert default_compute_device({CPU}, prefer_cuda=True) == CPU
    assert default_compute_device(set()) == CPU


@pytest.mark.usefixtures("cuda_present")
def test_parameters_decide_unless_offloaded_from_the_cpu() -> None:
    assert default_compute_device({CPU}) == CPU
    assert default_compute_device({torch.device("cuda")}) == CUDA1  # no index: the current device
    assert default_compute_device({torch.device("cuda", 0)}, prefer_cuda=True) == torch.device("cuda", 0)
    # fairscale: FSDP(cpu_model, move_params_to_cpu=True) keeps the shards on the host, computes on CUDA
    assert default_compute_device({CPU}, prefer_cuda=True) == CUDA1


@pytest.mark.usefixtures("cuda_present")
def test_a_module_without_parameters_follows_its_inner_wrappers() -> None:
    assert default_compute_device(set(), {CPU}) == CPU
    assert default_compute_device(set(), {CPU, torch.device("cuda", 0)}) == CUDA1  # no single device
    assert default_compute_device(set()) == CUDA1
    assert default_compute_device(set(), set()) == CUDA1


@pytest.mark.usefixtures("single_rank_group", "cuda_present")
def test_a_root_without_parameters_of_its_own_stays_with_cpu_inner_wrappers() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(1))
            self.a = FSDP(nn.Linear(4, 4))
            self.b = FSDP(nn.Linear(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * self.scale

    root = FSDP(Holder())
    assert root.compute_device == CPU
    assert root.module.scale.device == CPU  # the owned buffer was not sent to the (simulated) GPU


@pytest.mark.usefixtures("single_rank_group")
def test_only_an_nccl_group_is_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not backend_is_cuda_only(None)  # the gloo group of these tests
    for backend, cuda_only in (("nccl", True), ("cpu:gloo,cuda:nccl", False), ("gloo", False)):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None, b=backend: b)
        assert backend_is_cuda_only(None) is cuda_only


def test_forward_prefetch_defaults_on_where_the_host_computes() -> None:
    def on(device: str, requested: bool | None) -> bool:
        return Scheduler(
            ScheduleConfig(forward_prefetch=requested), DeviceHandle(torch.device(device))
        ).forward

    assert on("cpu", None) and not on("cuda", None)  # CUDA overlaps through the host running ahead
    assert on("cuda", True) and not on("cpu", False)
    with pytest.raises(TypeError):
        ScheduleConfig(forward_prefetch="yes")  # type: ignore[arg-type]
