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
from fsdp.api import ScheduleConfig
from fsdp.comm.schedule import Scheduler
from fsdp.comm.topology import backend_has_cuda, backend_is_cuda_only
from fsdp.common.device import DeviceHandle, default_compute_device

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


def test_a_cuda_device_without_index_means_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # tensors on it report cuda:N; a compute device named "cuda" would compare unequal to their
    # device (a copy in every state_dict()) and get side streams of its own
    from fsdp.comm.topology import checked_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("compute_device", "state_dict_device"):
        assert checked_device("cuda", name) == CUDA1
        assert checked_device(torch.device("cuda", 0), name) == torch.device("cuda", 0)
    assert checked_device("cpu", "compute_device") == CPU


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


@pytest.mark.usefixtures("single_rank_group", "cuda_present")
def test_a_meta_model_under_gloo_materializes_on_the_cpu() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    wrapped = FSDP(model)  # gloo, no compute_device: the simulated GPU is not where compute goes
    assert wrapped.compute_device == CPU
    assert {p.device for p in wrapped.parameters()} == {CPU}


@pytest.mark.usefixtures("single_rank_group")
def test_which_groups_have_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    for backend, has_cuda in (("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False), ("fake", False)):
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None, b=backend: b)
        assert backend_has_cuda(None) is has_cuda


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


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("mixed", [False, True])
def test_the_gather_limiter_never_stalls_the_host_at_world_size_1(
    monkeypatch: pytest.MonkeyPatch, mixed: bool
) -> None:
    # CUDA's events simulated: the limiter records one at each free of a gathered unit and blocks the
    # host on the second-to-last before a gather. At world size 1 nothing is gathered (fp32: the full
    # parameter is the shard; mixed precision: a cast on the compute stream, whose memory the caching
    # allocator reuses in stream order), so a wait would only stall the host behind the device.
    # See [Note: limit_all_gathers]; tests/distributed/test_schedule.py checks world size 2.
    recorded: list[object] = []
    waited: list[object] = []

    def record_event(self: DeviceHandle, stream: object) -> object:
        recorded.append(object())
        return recorded[-1]

    monkeypatch.setattr(DeviceHandle, "record_event", record_event)
    monkeypatch.setattr(DeviceHandle, "synchronize_event", lambda self, event: waited.append(event))
    torch.manual_seed(0)
    kwargs = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if mixed else {}
    model = FSDP(nn.Sequential(*[FSDP(nn.Linear(8, 8), **kwargs) for _ in range(4)]), **kwargs)
    for _ in range(2):
        model(torch.randn(2, 8)).float().sum().backward()
    assert recorded == [] and waited == []


@pytest.mark.usefixtures("single_rank_group")
def test_sharded_values_keep_host_rows_on_a_cuda_mesh() -> None:
    # Under CPU offload the sharded state dicts' rows stay where the shards live, the host, while the
    # mesh is the compute device's (CUDA). DTensor.from_local would copy them to the mesh's device:
    # the whole rank's state on the GPU at once. No tensor is put on the (absent) GPU here.
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh

    from fsdp.core.layout import empty_sharded, to_sharded

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cuda")
    layout = SimpleNamespace(world_size=1, rank=0, device=CUDA1)
    full = torch.arange(12.0).view(4, 3)
    rows = to_sharded(full, layout, mesh, CPU)  # type: ignore[arg-type]
    template = empty_sharded((4, 3), torch.float32, layout, mesh, CPU)  # type: ignore[arg-type]
    for value in (rows, template):
        assert value.device_mesh.device_type == "cuda" and value.to_local().device == CPU
        assert tuple(value.shape) == (4, 3)
    assert torch.equal(rows.to_local(), full) and rows.to_local().data_ptr() != full.data_ptr()
