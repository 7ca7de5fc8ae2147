"""Public configuration types and the validated config objects the wrapper is built from.

The fairscale-style constructor takes ~20 keyword arguments. They are folded here into a few
frozen dataclasses that validate themselves, so the rest of the library reads one coherent
config instead of loose flags that only make sense together.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CommConfig",
    "FSDPConfig",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "MemoryState",
    "MixedPrecision",
    "OffloadConfig",
    "PrecisionConfig",
    "ProcessGroupName",
    "ScheduleConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "TorchOptions",
    "TrainingState",
    "from_torch_fsdp",
]


def _torch_twin(value: Any, cls: type) -> bool:
    """Whether ``value`` is torch FSDP's object of the same name as ``cls`` (``torch.distributed.fsdp``)."""
    kind = type(value)
    return kind.__name__ == cls.__name__ and kind.__module__.startswith("torch.distributed.fsdp")


class _TwinEnum(enum.Enum):
    """An enum whose members equal torch FSDP's members of the same name (``model.sharding_strategy ==
    torch.distributed.fsdp.ShardingStrategy.FULL_SHARD`` holds), and hash alike (by name, as torch's)."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and _torch_twin(other, type(self)):
            return self.name == other.name
        return self is other

    def __hash__(self) -> int:
        return hash(self._name_)


def _twin_eq(self: Any, other: object) -> bool:
    """``__eq__`` of an option dataclass: field by field, with its own class or with torch's twin."""
    if type(other) is not type(self) and not _torch_twin(other, type(self)):
        return NotImplemented  # type: ignore[no-any-return]
    names = [f.name for f in dataclasses.fields(self)]
    return all(hasattr(other, n) for n in names) and all(getattr(self, n) == getattr(other, n) for n in names)


class OptimStateKeyType(enum.Enum):
    """How :meth:`FullyShardedDataParallel.rekey_optim_state_dict` keys an optimizer state dict
    (torch FSDP1's names): by parameter name (the full form), or by parameter id (a position in the
    optimizer's parameter list, what a plain optimizer's ``state_dict()`` holds)."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


class TrainingState(enum.Enum):
    """Where a wrapper is in the training step; asserted at the entry of every hook.

    IDLE -> FORWARD -> IDLE (between forward and backward) -> BACKWARD_PRE -> BACKWARD_POST -> IDLE
    (reset by the root's end-of-backward callback). SUMMON_FULL_PARAMS holds while the user sees
    full parameters. Every change is checked against :data:`TRAINING_TRANSITIONS`.
    """

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


_S = TrainingState
# The legal changes of a wrapper's training state: old -> the states it may go to. A wrapper whose
# frozen parameters get no post-backward goes from BACKWARD_PRE straight back to IDLE; every handle's
# post-backward sets BACKWARD_POST again.
TRAINING_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    _S.IDLE: frozenset({_S.FORWARD, _S.BACKWARD_PRE, _S.SUMMON_FULL_PARAMS}),
    _S.FORWARD: frozenset({_S.IDLE}),
    _S.BACKWARD_PRE: frozenset({_S.BACKWARD_POST, _S.IDLE}),
    _S.BACKWARD_POST: frozenset({_S.BACKWARD_POST, _S.IDLE}),
    _S.SUMMON_FULL_PARAMS: frozenset({_S.IDLE}),
}
del _S

_E = TypeVar("_E", bound=enum.Enum)


def check_transition(what: str, old: _E, new: _E, legal: Mapping[_E, frozenset[_E]]) -> None:
    """Raise ``RuntimeError`` unless ``old -> new`` is one of the ``legal`` transitions of the state
    machine ``what`` (e.g. "training state"). Every state machine of the package changes through it."""
    if new not in legal[old]:
        allowed = ", ".join(sorted(s.name for s in legal[old])) or "none"
        raise RuntimeError(
            f"FullyShardedDataParallel: illegal {what} transition {old.name} -> {new.name} (from {old.name} "
            f"only to {allowed}); a forward, backward or summon_full_params() did not finish, or ran inside another"
        )


class MemoryState(enum.Enum):
    """Which tensor a flat parameter's ``.data`` is, and whether its full parameter stays in memory.
    See [Note: flat parameter data].

    SHARDED: ``.data`` is the shard; the full buffers are freed. FULL_KEPT: ``.data`` is the shard,
    and the full parameter gathered for it is kept from the last forward or backward (the root,
    ``reshard_after_forward=False``, ``no_sync``), so the next unshard gathers nothing while the
    shard is unchanged. UNSHARDED: ``.data`` is a full buffer. Changes follow :data:`MEMORY_TRANSITIONS`.
    """

    SHARDED = enum.auto()
    FULL_KEPT = enum.auto()
    UNSHARDED = enum.auto()


_M = MemoryState
MEMORY_TRANSITIONS: dict[MemoryState, frozenset[MemoryState]] = {
    _M.SHARDED: frozenset({_M.UNSHARDED}),
    _M.FULL_KEPT: frozenset({_M.UNSHARDED, _M.SHARDED}),
    _M.UNSHARDED: frozenset({_M.SHARDED, _M.FULL_KEPT}),
}
del _M


class ProcessGroupName(str, enum.Enum):
    """Names of process groups the wrapper may create for itself (fairscale-compatible).

    ``reduce_scatter`` (the default of ``process_group_reduce_scatter``) gives reductions a group
    of their own, with the same ranks as ``process_group``, so that they can run concurrently with
    all-gathers; ``default`` reuses ``process_group``.
    """

    default = "default"
    reduce_scatter = "reduce_scatter"


class ShardingStrategy(_TwinEnum):
    """How parameters, gradients and optimizer state are spread over ranks (torch FSDP's names).

    - ``FULL_SHARD``: shard everything; full parameters exist only around each unit's forward and
      backward (two all-gathers and one reduce-scatter per step).
    - ``SHARD_GRAD_OP``: shard gradients and optimizer state; keep full parameters from forward to
      backward (``reshard_after_forward=False``: one all-gather, one reduce-scatter).
    - ``NO_SHARD``: replicate like DDP; gradients are all-reduced, overlapped with backward.
    - ``HYBRID_SHARD``: full sharding within a group of ranks (e.g. a node), replication across
      groups: reduce-scatter in the shard group, then all-reduce of the shard across replicas.
    - ``_HYBRID_SHARD_ZERO2`` (torch's name): ``HYBRID_SHARD`` that keeps full parameters from
      forward to backward, as ``SHARD_GRAD_OP`` does (``reshard_after_forward=False``).
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


class StateDictType(_TwinEnum):
    """What ``state_dict()`` and ``load_state_dict()`` of a wrapper mean (torch FSDP's names), chosen
    with :meth:`FullyShardedDataParallel.state_dict_type` or ``set_state_dict_type``.

    - ``FULL_STATE_DICT`` (the default, fairscale's only kind): full tensors under the unwrapped
      model's names; loads at any world size.
    - ``LOCAL_STATE_DICT``: this rank's flat shards (``local_state_dict()``); loads only at the same
      world size and wrap plan.
    - ``SHARDED_STATE_DICT``: each parameter as a row-sharded ``DTensor`` under its unwrapped name
      (``sharded_state_dict()``), for ``torch.distributed.checkpoint``; loads at any world size.
    """

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


class StateDictSettings(NamedTuple):
    """A wrapper's state dict setting, as torch FSDP's ``set_state_dict_type`` returns it (so
    ``FSDP.set_state_dict_type(model, *previous)`` restores it) and ``get_state_dict_type`` reads it."""

    state_dict_type: StateDictType
    state_dict_config: Any = None
    optim_state_dict_config: Any = None


@dataclass(frozen=True)
class CPUOffload:
    """torch FSDP's offload option: ``cpu_offload=CPUOffload(offload_params=True)`` is
    ``move_params_to_cpu=True`` (the gradients follow the parameters)."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_params: bool = False


class BackwardPrefetch(_TwinEnum):
    """torch FSDP's ``backward_prefetch`` values: the all-gather of the unit whose backward comes
    next is launched when a unit's backward starts (``BACKWARD_PRE``, overlapping this unit's
    gradient computation), or once its gradients are reduced and its full parameters freed
    (``BACKWARD_POST``: less overlap, one full unit fewer held). ``None`` (or ``False``) turns
    prefetch off; ``True`` is ``BACKWARD_PRE``."""

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


@dataclass(frozen=True)
class FullStateDictConfig:
    """torch FSDP's options of a full state dict, for ``FSDP.state_dict_type(model,
    StateDictType.FULL_STATE_DICT, FullStateDictConfig(...))``: ``offload_to_cpu`` puts the values
    on the CPU, ``rank0_only`` gives them to rank 0 alone (the other ranks get an empty dict)."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_to_cpu: bool = False
    rank0_only: bool = False


@dataclass(frozen=True)
class ShardedStateDictConfig:
    """torch FSDP's options of a sharded state dict. ``offload_to_cpu=True`` is accepted where
    compute runs on the CPU (the shards are there already) and refused on a GPU."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class LocalStateDictConfig:
    """torch FSDP's options of a local state dict. ``offload_to_cpu=True`` is accepted where compute
    runs on the CPU and refused on a GPU."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullOptimStateDictConfig:
    """torch FSDP's options of the full optimizer state dict that ``FSDP.optim_state_dict`` returns
    under ``FULL_STATE_DICT``: ``rank0_only`` gives it to rank 0 alone (the other ranks get an empty
    dict). It is always built on the CPU, so ``offload_to_cpu`` changes nothing."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_to_cpu: bool = True
    rank0_only: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig:
    """torch FSDP's options of a sharded optimizer state dict. Its shards stay where the optimizer
    keeps its state (the CPU under ``move_params_to_cpu``), whatever ``offload_to_cpu`` says."""

    __eq__ = _twin_eq  # (also equal to torch's twin)

    offload_to_cpu: bool = True


_TORCH_TWINS: dict[str, type] = {}  # class name in torch.distributed.fsdp -> ours (filled below)


def from_torch_fsdp(value: Any) -> Any:
    """``value`` as this library's type when it is one of torch FSDP's option objects
    (``torch.distributed.fsdp.ShardingStrategy``, ``BackwardPrefetch``, ``StateDictType``,
    ``MixedPrecision``, ``CPUOffload`` and the state dict configs); anything else as it is. So code
    that only changed the import of the wrapper keeps working with torch's own option objects."""
    cls = type(value)
    ours: Any = _TORCH_TWINS.get(cls.__name__)
    if ours is None or not cls.__module__.startswith("torch.distributed.fsdp"):
        return value
    if isinstance(value, enum.Enum):
        if value.name not in ours.__members__:
            raise ValueError(
                f"FullyShardedDataParallel: torch FSDP's {cls.__name__}.{value.name} is not supported; the supported "
                f"values are {', '.join(ours.__members__)}"
            )
        return ours[value.name]
    fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(ours) if hasattr(value, f.name)}
    return ours(**fields)


def _flag(name: str, value: Any) -> bool:
    """A fairscale on/off flag: a bool, or what fairscale's ``or`` accepts alike (``None``, 0, 1)."""
    if value is None or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    _check_bool(name, value)
    return bool(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"FullyShardedDataParallel: `{name}` must be a bool, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How parameters are laid out and when full parameters are freed."""

    reshard_after_forward: bool = True
    disable_reshard_on_root: bool = True
    flatten_parameters: bool = True
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD

    def __post_init__(self) -> None:
        for name in ("reshard_after_forward", "disable_reshard_on_root", "flatten_parameters"):
            _check_bool(name, getattr(self, name))


_LOW_OR_FULL = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MixedPrecision:
    """Mixed precision, field for field torch FSDP's; accepted as ``mixed_precision=`` by the wrapper.

    Each dtype left ``None`` means no cast of that kind. The fp32 shard stays the master copy the
    optimizer updates. With ``param_dtype`` it is cast to ``param_dtype`` before the all-gather (so
    the all-gather moves ``param_dtype`` bytes) and compute runs in it. Gradients are reduced in
    ``reduce_dtype`` (default: ``param_dtype``) and land on the shard in its dtype. Floating-point
    buffers are cast to ``buffer_dtype`` (default: kept as they are). ``cast_root_forward_inputs``:
    the root casts the floating tensors among its inputs to ``param_dtype`` (recorded by autograd);
    ``cast_forward_inputs``: every wrapper does. ``keep_low_precision_grads=True``: after backward the
    shard gradients are left in the reduction dtype (``reduce_dtype``, else ``param_dtype``), as in
    torch; they are accumulated in the master dtype across backward passes in between.
    ``_module_classes_to_ignore``: with the constructor's ``auto_wrap_policy``, modules of these
    classes (batch norm by default) get wrappers of their own in full precision and run in fp32,
    their inputs cast to fp32 and their outputs back to the inputs' dtype.

    ``mixed_precision=True`` with fairscale's flags maps onto
    ``MixedPrecision(compute_dtype or float16, float32 if fp32_reduce_scatter else None,
    buffer_dtype or compute_dtype or float16)``.
    """

    __eq__ = _twin_eq  # (also equal to torch's twin)

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: tuple[type[torch.nn.Module], ...] = (torch.nn.modules.batchnorm._BatchNorm,)

    def __bool__(self) -> bool:
        """Whether parameters are cast (``param_dtype`` is set): what fairscale's ``mixed_precision``
        flag says, so ``if model.mixed_precision:`` reads alike for both construction styles."""
        return self.param_dtype is not None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _LOW_OR_FULL:
                raise ValueError(
                    f"MixedPrecision: `{name}` must be torch.float16, torch.bfloat16, torch.float32 or None, got "
                    f"{value!r}"
                )
        for name in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
            _check_bool(name, getattr(self, name))
        classes = self._module_classes_to_ignore
        if not isinstance(classes, (tuple, list, set, frozenset)) or not all(
            isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes
        ):
            raise TypeError(
                f"MixedPrecision: `_module_classes_to_ignore` must be a sequence of nn.Module classes, got {classes!r}"
            )


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Resolved dtypes of one wrapper.

    ``param_dtype`` None means no casting: parameters are gathered and used in their own dtype
    (full precision, or pure fp16/bf16 when the parameters themselves are low precision).
    """

    param_dtype: torch.dtype | None = None  # dtype of the all-gather and of compute
    reduce_dtype: torch.dtype | None = None  # dtype of the gradient reduction (None: gradient dtype)
    buffer_dtype: torch.dtype | None = None  # floating-point buffers are cast to this (None: kept)
    cast_root_forward_inputs: bool = False  # the root casts floating inputs to param_dtype
    force_input_to_fp32: bool = False  # every wrapper casts fp16/bf16 inputs to fp32 (full precision)
    clear_autocast_cache: bool = False  # clear torch.autocast's weight cache after each forward
    cast_forward_inputs: bool = False  # every wrapper casts floating inputs to param_dtype
    # torch's casts (a MixedPrecision): every floating dtype, recorded by autograd; fairscale's
    # (mixed_precision=True): fp32 inputs only, and the root's cast unrecorded
    torch_input_casts: bool = False
    # the shard gradients stay in the reduction dtype after backward (torch's keep_low_precision_grads)
    keep_low_precision_grads: bool = False

    def __post_init__(self) -> None:
        for name in (
            "keep_low_precision_grads",
            "cast_root_forward_inputs",
            "force_input_to_fp32",
            "clear_autocast_cache",
            "cast_forward_inputs",
            "torch_input_casts",
        ):
            _check_bool(name, getattr(self, name))
        if self.force_input_to_fp32 and self.param_dtype is not None:
            raise ValueError(
                "FullyShardedDataParallel: force_input_to_fp32=True is for full precision; it cannot be combined "
                "with mixed precision. Drop one of them"
            )

    @property
    def mixed(self) -> bool:
        return self.param_dtype is not None

    @property
    def low_grad_dtype(self) -> torch.dtype | None:
        """The dtype shard gradients are left in after backward (``keep_low_precision_grads``), or None."""
        return (self.reduce_dtype or self.param_dtype) if self.keep_low_precision_grads else None


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """Process groups and gradient reduction arithmetic.

    A flat parameter is sharded over ``process_group`` (``world_size`` ranks, this one is ``rank``;
    1 for NO_SHARD). Gradient shards are then all-reduced over ``replicate_group`` when there is one
    (NO_SHARD: every rank; HYBRID_SHARD: the ranks holding the same shard). ``dp_group`` spans every
    rank that trains the model (``dp_world_size`` = ``world_size`` x replicas).

    ``gradient_predivide_factor`` divides gradients before the reduction and
    ``gradient_postdivide_factor`` after it; their product is ``dp_world_size``, so the result is
    the mean over ranks while the summed values stay small (fp16 overflow at large world sizes).
    """

    process_group: dist.ProcessGroup
    process_group_reduce_scatter: dist.ProcessGroup
    world_size: int
    rank: int
    bucket_cap_mb: float
    gradient_predivide_factor: float
    gradient_postdivide_factor: float
    replicate_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None  # None: process_group
    dp_world_size: int = 0  # 0: world_size
    dp_rank: int = -1  # -1: rank

    def __post_init__(self) -> None:
        if self.bucket_cap_mb < 0:  # fairscale: a value <= 0 disables bucketing
            object.__setattr__(self, "bucket_cap_mb", 0.0)
        for name in ("gradient_predivide_factor", "gradient_postdivide_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FullyShardedDataParallel: `{name}` must be > 0, got {getattr(self, name)}")
        if self.dp_group is None:
            object.__setattr__(self, "dp_group", self.process_group)
        if self.dp_world_size == 0:
            object.__setattr__(self, "dp_world_size", self.world_size)
        if self.dp_rank < 0:
            object.__setattr__(self, "dp_rank", self.rank)


@dataclass(frozen=True, kw_only=True)
class StateDictConfig:
    """Where full state dict values go and who receives them."""

    state_dict_device: torch.device | None = None
    state_dict_on_rank_0_only: bool = False

    def __post_init__(self) -> None:
        _check_bool("state_dict_on_rank_0_only", self.state_dict_on_rank_0_only)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """CPU offload of the master shards and their gradients (fairscale's ``move_params_to_cpu``).

    With a CUDA compute device the fp32 shard lives in pinned host memory, is copied to the device
    for each all-gather, and the reduced gradient shard is copied back, so the optimizer steps on the
    CPU. On a CPU compute device the options change nothing (the data is already there).
    """

    params_to_cpu: bool = False
    grads_to_cpu: bool = False

    @classmethod
    def from_flags(cls, move_params_to_cpu: Any, cpu_offload: Any, move_grads_to_cpu: Any) -> OffloadConfig:
        """fairscale's flags: ``cpu_offload`` is an older name of ``move_params_to_cpu``; ``None`` for
        ``move_grads_to_cpu`` follows them."""
        if isinstance(cpu_offload, CPUOffload):  # torch FSDP's spelling
            cpu_offload = cpu_offload.offload_params
        params = _flag("move_params_to_cpu", move_params_to_cpu) or _flag("cpu_offload", cpu_offload)
        grads = params if move_grads_to_cpu is None else _flag("move_grads_to_cpu", move_grads_to_cpu)
        return cls(params_to_cpu=params, grads_to_cpu=grads)

    def __post_init__(self) -> None:
        _check_bool("move_params_to_cpu", self.params_to_cpu)
        _check_bool("move_grads_to_cpu", self.grads_to_cpu)
        if self.params_to_cpu != self.grads_to_cpu:
            raise ValueError(
                "FullyShardedDataParallel: move_grads_to_cpu must equal move_params_to_cpu: a torch optimizer "
                "needs each gradient on its parameter's device. Leave move_grads_to_cpu unset (it follows "
                "move_params_to_cpu)"
            )


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """When all-gathers are launched (the root's values govern the whole tree).

    ``backward_prefetch``: when a unit's backward starts, launch the all-gather of the unit whose
    backward comes next, so it overlaps this unit's gradient computation; with
    ``backward_prefetch_post`` (torch's ``BACKWARD_POST``) only once this unit's gradients are
    reduced and its full parameters freed, so at most one full unit is held (less overlap).
    ``forward_prefetch``: likewise in forward, following the order recorded in the first iteration
    (if a later iteration runs units in another order, forward prefetch stops, with a warning).
    ``None`` (the default): on where the host computes (CPU), off on CUDA, and a change of order
    stops it silently. See [Note: prefetch] in fsdp/comm/schedule.py.
    ``limit_all_gathers``: on CUDA, the host waits before gathering a unit while two freed units'
    compute has not finished, so a fast host cannot run ahead and hold many full units; on CPU the
    host runs in step with the computation and it changes nothing.
    """

    backward_prefetch: bool = True
    forward_prefetch: bool | None = None
    limit_all_gathers: bool = True
    backward_prefetch_post: bool = False

    def __post_init__(self) -> None:
        for name in ("backward_prefetch", "limit_all_gathers", "backward_prefetch_post"):
            _check_bool(name, getattr(self, name))
        if self.forward_prefetch is not None:
            _check_bool("forward_prefetch", self.forward_prefetch)


@dataclass(frozen=True, kw_only=True)
class TorchOptions:
    """How a wrapper was built, torch FSDP1's way or fairscale's, decided once from the constructor's
    arguments as given (``fsdp.wrapper.torch_compat.torch_options_of``). Where the two libraries differ
    (``model.module``, the flat parameters' names, the ``mixed_precision`` / ``cpu_offload``
    attributes) a wrapper follows the one it was built for.

    ``torch_style``: built torch's way. ``mixed_precision`` / ``cpu_offload``: the values given (a
    torch option object as this library's). ``full_prec_in_eval``: ``FSDP_USE_FULL_PREC_IN_EVAL=1``
    at construction (as torch reads it)."""

    torch_style: bool = False
    mixed_precision: MixedPrecision | bool | None = False
    cpu_offload: CPUOffload | bool | None = False
    full_prec_in_eval: bool = False

    def shown_mixed_precision(self, mixed: bool) -> bool | MixedPrecision:
        """``model.mixed_precision``: fairscale's flag (``mixed``), or on a wrapper built torch's way
        torch's object (``MixedPrecision()`` when none was given), unless fairscale's ``True`` was given."""
        if isinstance(self.mixed_precision, MixedPrecision):
            return self.mixed_precision
        if not self.torch_style or self.mixed_precision is True:
            return mixed
        return _NO_MIXED_PRECISION

    def shown_cpu_offload(self, params_to_cpu: bool) -> bool | CPUOffload:
        """``model.cpu_offload``: fairscale's flag (``params_to_cpu``), or on a wrapper built torch's way
        torch's ``CPUOffload(offload_params=...)``, unless fairscale's ``True`` was given."""
        if isinstance(self.cpu_offload, CPUOffload):
            return self.cpu_offload
        if not self.torch_style or self.cpu_offload is True:
            return params_to_cpu
        return _CPU_OFFLOAD[params_to_cpu]


_NO_MIXED_PRECISION = MixedPrecision()  # (frozen: one object serves every wrapper)
_CPU_OFFLOAD = {flag: CPUOffload(offload_params=flag) for flag in (False, True)}


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Everything a wrapper was configured with, validated once at construction."""

    sharding: ShardingConfig
    precision: PrecisionConfig
    comm: CommConfig
    state_dict: StateDictConfig
    compute_device: torch.device
    offload: OffloadConfig = OffloadConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    no_broadcast_optim_state: bool = False
    allow_reset_parameters: bool = False
    verbose: bool = False


_TORCH_TWINS.update(
    (cls.__name__, cls)
    for cls in (
        ShardingStrategy,
        BackwardPrefetch,
        StateDictType,
        MixedPrecision,
        CPUOffload,
        FullStateDictConfig,
        ShardedStateDictConfig,
        LocalStateDictConfig,
        FullOptimStateDictConfig,
        ShardedOptimStateDictConfig,
    )
)


def default_gradient_predivide_factor(world_size: int) -> float:
    """The smallest power of two ``f`` that divides ``world_size`` with ``f * f >= world_size``.

    Stops early at an ``f`` that no longer divides the world size (e.g. 2 for 3 ranks), exactly as
    fairscale chooses it. Examples: 1 -> 1, 2 -> 2, 4 -> 2, 8 -> 4, 16 -> 4, 3 -> 2.
    """
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)
