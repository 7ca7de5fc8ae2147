"""The attributes a fairscale ``FullyShardedDataParallel`` exposes, read from the wrapper's config.

fairscale stores its constructor arguments, resolved, as plain attributes (``model.compute_dtype``,
``model.gradient_postdivide_factor``, ...), and code written for it reads them. Here they are
read-only properties over :class:`~fsdp.api.FSDPConfig`, mixed into the wrapper. Where the
wrapped module has an attribute of the same name (``nn.LSTM.flatten_parameters``, a model's own
``verbose``), that attribute wins, as it did when lookups fell through to the module. Also
fairscale's ``named_parameters()``: plain names inside ``summon_full_params`` and for parameters
that are not flattened, and fairscale's (or torch FSDP1's) names of the flat parameters outside it;
``model.module`` as fairscale's ``FlattenParamsWrapper`` level for a wrapper built fairscale's way
(:class:`FlattenParamsLevel`); two steps of fairscale's forward under its method names; and the
state fairscale keeps in attributes of its own, read from the handles and the root's context
(``has_full_params``, ``_require_backward_grad_sync``), with its debugging aid ``_print_r0``
(logged, never printed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy, TrainingState
from fsdp.comm.consistency import WRAPPED, plain_name
from fsdp.common.device import allocated_bytes
from fsdp.core.wrapper_protocol import Wrapper, WrapperMixin
from fsdp.wrapper.shared_params import check_shared_param

__all__ = ["FairscaleAttributes", "FlattenParamsLevel", "is_expert"]

log = logging.getLogger(__name__)
_GB = 1024**3


class FlattenParamsLevel:
    """``model.module`` of a wrapper built fairscale's way: fairscale's ``FlattenParamsWrapper``
    level, whose ``.module`` is the wrapped module (fairseq's ``unwrapped_module`` reads
    ``model.module.module``). Everything else is the wrapped module's: attributes, calls, indexing,
    and ``isinstance`` (its ``__class__`` is the module's). Not a module of the tree: the wrapper
    holds the module directly, and this object only stands for the level fairscale had."""

    __slots__ = ("__weakref__", "module")
    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        object.__setattr__(self, "module", module)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(model.module, nn.Module / MyModel) holds
        return type(object.__getattribute__(self, "module"))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "module"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "module":
            raise AttributeError(
                "FlattenParamsWrapper.module cannot be replaced; wrap the new module instead"
            )
        setattr(self.module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        module: Any = self.module
        return module[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        module: Any = self.module
        module[key] = value

    def __delitem__(self, key: Any) -> None:
        module: Any = self.module
        del module[key]

    def __len__(self) -> int:
        module: Any = self.module
        return len(module)

    def __iter__(self) -> Iterator[Any]:
        module: Any = self.module
        return iter(module)  # type: ignore[no-any-return]

    def __dir__(self) -> list[str]:
        return sorted({"module", *dir(self.module)})

    def __repr__(self) -> str:
        return f"FlattenParamsWrapper({self.module!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # (pickled or copied alone: the module it stands for)
        return self.module.__reduce_ex__(protocol)


def _option(read: Callable[[Any], Any]) -> property:
    """A read-only fairscale attribute, unless the wrapped module has one of that name."""
    name = read.__name__

    def get(self: Any) -> Any:
        module = self.__dict__.get("_modules", {}).get("_fsdp_wrapped_module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        return read(self)

    return property(get, doc=read.__doc__)


def _field(name: str, path: str) -> property:
    """:func:`_option` for a value stored as is in the config (``path`` below ``fsdp_config``)."""

    def read(self: Any) -> Any:
        value = self.fsdp_config
        for part in path.split("."):
            value = getattr(value, part)
        return value

    read.__name__ = name
    read.__doc__ = f"``fsdp_config.{path}`` (fairscale's ``{name}``)."
    return _option(read)


def is_expert(wrapper: Wrapper, root: Wrapper) -> bool:
    """Whether ``wrapper`` is an expert under ``root`` as fairscale defines one: its process group
    holds one rank while the root trains over more, so each rank holds other parameters there."""
    mine, roots = wrapper.fsdp_config.comm, root.fsdp_config.comm
    return (
        wrapper is not root
        and mine.dp_world_size == 1
        and roots.dp_world_size > 1
        and mine.process_group is not roots.process_group
    )


class FairscaleAttributes(WrapperMixin):
    """fairscale's attributes and debugging aids on the wrapper (see the module docstring)."""

    def extra_repr(self) -> str:
        sharding = self.fsdp_config.sharding
        numel = sum(h.meta.numel for h in self.handles)
        local = sum(h.spec.chunk for h in self.handles)
        text = (
            f"world_size={self.world_size}, rank={self.rank}, flatten_parameters={sharding.flatten_parameters}, "
            f"reshard_after_forward={sharding.reshard_after_forward}, flat_params={len(self.handles)}, "
            f"numel={numel}, local_numel={local}"
        )
        if self.fsdp_config.verbose:
            text += (
                f", is_root={self._is_root}, training_state={self.training_state.name}, "
                f"disable_reshard_on_root={sharding.disable_reshard_on_root}, "
                f"compute_device={self.compute_device}, bucket_cap_mb={self.fsdp_config.comm.bucket_cap_mb}, "
                f"gradient_predivide_factor={self.fsdp_config.comm.gradient_predivide_factor}, "
                f"state_dict_device={self.fsdp_config.state_dict.state_dict_device}, "
                f"state_dict_on_rank_0_only={self.fsdp_config.state_dict.state_dict_on_rank_0_only}"
            )
        return text

    @property
    def world_size(self) -> int:
        """Ranks that train this model together (all of them, whatever the sharding strategy)."""
        return self.fsdp_config.comm.dp_world_size

    @property
    def rank(self) -> int:
        """This rank's index among :attr:`world_size`."""
        return self.fsdp_config.comm.dp_rank

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.fsdp_config.comm.process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup) -> None:
        """fairscale's idiom after unpickling (or building with a stand-in of several ranks): give every
        wrapper the real group, ``for m in model.modules(): m.process_group = group``. The group must
        hold this process where the shards were built for; reductions share it."""
        self._bind(group)

    @property
    def process_group_reduce_scatter(self) -> Any:
        """The group gradients are reduce-scattered over (fairscale's attribute)."""
        return self.fsdp_config.comm.process_group_reduce_scatter

    @process_group_reduce_scatter.setter
    def process_group_reduce_scatter(self, group: Any) -> None:
        """fairscale's idiom after unpickling: ``m.process_group_reduce_scatter = dist.new_group()`` on
        every wrapper, after ``m.process_group = group``. A group of the same ranks as
        ``process_group``, or ``ProcessGroupName.default`` (reduce over ``process_group`` itself)."""
        self._bind_reduce_scatter(group)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.fsdp_config.sharding.strategy

    @property
    def compute_device(self) -> torch.device:
        return self.fsdp_config.compute_device

    @property
    def move_params_to_cpu(self) -> bool:
        return self.fsdp_config.offload.params_to_cpu

    @property
    def move_grads_to_cpu(self) -> bool:
        return self.fsdp_config.offload.grads_to_cpu

    @property
    def cpu_offload(self) -> bool | CPUOffload:
        """fairscale's older name of :attr:`move_params_to_cpu`; on a wrapper built torch's way,
        torch's ``CPUOffload`` object (``model.cpu_offload.offload_params``)."""
        return self._torch_options.shown_cpu_offload(self.move_params_to_cpu)

    # fairscale's resolved options, as stored
    force_input_to_fp32 = _field("force_input_to_fp32", "precision.force_input_to_fp32")
    clear_autocast_cache = _field("clear_autocast_cache", "precision.clear_autocast_cache")
    flatten_parameters = _field("flatten_parameters", "sharding.flatten_parameters")
    disable_reshard_on_root = _field("disable_reshard_on_root", "sharding.disable_reshard_on_root")
    bucket_cap_mb = _field("bucket_cap_mb", "comm.bucket_cap_mb")
    gradient_predivide_factor = _field("gradient_predivide_factor", "comm.gradient_predivide_factor")
    gradient_postdivide_factor = _field("gradient_postdivide_factor", "comm.gradient_postdivide_factor")
    state_dict_on_rank_0_only = _field("state_dict_on_rank_0_only", "state_dict.state_dict_on_rank_0_only")

    @_option
    def no_broadcast_optim_state(self) -> bool:
        """fairscale's flag: given to the constructor, or set as fairscale's root sets it at its first
        forward, for a wrapper whose process group holds one rank inside a root over more (an expert)."""
        ctx = self._ctx if self._is_root is False else None
        root = ctx.wrappers[0] if ctx is not None and ctx.wrappers else None
        return self.fsdp_config.no_broadcast_optim_state or (root is not None and is_expert(self, root))

    allow_reset_parameters = _field("allow_reset_parameters", "allow_reset_parameters")
    verbose = _field("verbose", "verbose")
    # torch FSDP's
    forward_prefetch = _field("forward_prefetch", "schedule.forward_prefetch")
    limit_all_gathers = _field("limit_all_gathers", "schedule.limit_all_gathers")

    @_option
    def mixed_precision(self) -> bool | MixedPrecision:
        """Whether parameters are cast for the all-gather and compute (fairscale's flag); on a
        wrapper built torch's way, torch's ``MixedPrecision`` object (``MixedPrecision()`` when none
        was given), which is true when it casts the parameters."""
        return self._torch_options.shown_mixed_precision(self.fsdp_config.precision.mixed)

    @_option
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward run in (the parameters' own dtype without casting)."""
        dtype = self.fsdp_config.precision.param_dtype
        if dtype is None:
            dtype = self.handles[0].meta.dtype if self.handles else torch.get_default_dtype()
        return dtype

    @_option
    def buffer_dtype(self) -> torch.dtype:
        return self.fsdp_config.precision.buffer_dtype or self.compute_dtype

    @_option
    def fp32_reduce_scatter(self) -> bool:
        precision = self.fsdp_config.precision
        return precision.mixed and precision.reduce_dtype == torch.float32

    @_option
    def reshard_after_forward(self) -> bool:
        """Whether full parameters are freed after forward (the root's decision once it is known)."""
        return self._reshard_after_forward

    @_option
    def state_dict_device(self) -> torch.device:
        """Where ``state_dict()`` puts its values: the one given, else the CPU under
        ``move_params_to_cpu`` (as fairscale), else the compute device."""
        return self._state_dict_device()

    def _state_dict_device(self) -> torch.device:
        given = self.fsdp_config.state_dict.state_dict_device
        if given is not None:
            return given
        return torch.device("cpu") if self.move_params_to_cpu else self.compute_device

    @property
    def params(self) -> list[nn.Parameter]:
        """This wrapper's own flat parameters (fairscale name)."""
        return [h.flat_param for h in self.handles]

    @property
    def has_full_params(self) -> bool:
        """fairscale's flag: whether this wrapper's full parameters are gathered now. True while they are
        shown (forward, backward, ``summon_full_params``, ``state_dict``) and while a gathered copy is
        kept for backward (the root, ``reshard_after_forward=False``) and the shards have not changed
        since; always where the shard is the full parameter (one rank, no cast); False for a wrapper
        that owns no parameters."""
        return bool(self.handles) and all(h.holds_full for h in self.handles)

    @property
    def _require_backward_grad_sync(self) -> bool:
        """fairscale's flag: False inside the root's ``no_sync()`` (gradients accumulate locally), else
        True. The same on every wrapper of the tree. Read-only."""
        ctx = self._ctx
        return True if ctx is None else bool(ctx.sync)

    def _reset_lazy_init(self) -> None:
        """fairscale's: forget which wrapper is the root, so that the next forward sets the tree up
        again from the wrapper it runs on (fairseq calls it on inner wrappers before wrapping them in an
        outer one; VISSL on every wrapper after loading a checkpoint). The whole tree this wrapper
        belongs to is reset: it shares one context. Call it on every rank, between steps."""
        ctx = self._ctx
        if ctx is None:
            return
        root = ctx.wrappers[0]
        if not root._context_is_idle():
            raise RuntimeError(
                "FullyShardedDataParallel._reset_lazy_init: called during a step (a forward, backward or "
                "no_sync() of this wrapper tree is not over); call it between steps"
            )
        root._release_context()

    # fairscale's names for two steps of its forward, kept as methods that the forward calls through
    # ``self``: code written for fairscale patches or overrides them (to delay the free, to count the
    # registrations), and a replaced one takes the place of the original as it did there. (The third,
    # ``_register_pre_backward_hooks``, is the wrapper's own.)
    def _register_post_backward_hooks(self, token: Any = None) -> None:
        """Arm the post-backward hook of each flat parameter for the backward of the forward ``token``
        stands for (fairscale: called in every forward)."""
        for h in self.handles:
            h.accumulators.note(token)

    def _free_full_params(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """Free the full parameters of this wrapper (of the flat parameters in ``params`` only, if
        given) and point the module back at its shards, as fairscale's method of this name does at
        the end of a forward. Parameters that are not gathered are left as they are."""
        wanted = None if params is None else {id(p) for p in params}
        for h in self.handles:
            if wanted is None or id(h.flat_param) in wanted:
                h.reshard(free_full=True)

    def _print_r0(self, msg: str, restart: bool = False) -> None:
        """fairscale's debugging aid: on rank 0, log ``msg`` at INFO (this module's logger) with this
        rank's memory and the seconds since construction, or since the last call with ``restart=True``
        (which restarts the clock on every rank). On CUDA the memory is the caching allocator's now
        and at its peak (``memory_allocated`` / ``max_memory_allocated``, as fairscale);
        elsewhere, this tree's unshard buffers now and at their peak (``memory_stats()``)."""
        if restart:
            self._tstart = time.time()
        if self.rank != 0 or not log.isEnabledFor(logging.INFO):
            return
        device = allocated_bytes(self.compute_device)
        if device is not None:
            now, peak, what = device[0], device[1], ""
        else:
            stats = self.memory_stats()
            now, peak, what = stats["unsharded"], stats["unsharded_peak"], " unsharded"
        log.info(
            "%s%s cur=%.4f GB, max=%.4f GB, t=%.1f s",
            msg,
            what,
            now / _GB,
            peak / _GB,
            time.time() - self._tstart,
        )

    def non_shared_params(self) -> list[nn.Parameter]:
        """fairscale: the parameters not shared with another wrapper; here every one of ``params``
        (a parameter tied across wrappers is owned by the innermost wrapper around all its users)."""
        return self.params

    def append_shared_param(self, p: torch.Tensor) -> None:
        """fairscale's declaration that this wrapper's module uses ``p``, a parameter of another
        wrapper (or the placeholder that wrapper's module shows for it). Ties across wrappers are
        found without it (see [Note: parameters shared across wrappers] in
        ``fsdp/wrapper/shared_params.py``): this checks that the module does use ``p``, else ``ValueError``."""
        check_shared_param(self, p)

    @_option
    def numel_padded_per_param(self) -> list[int]:
        """Padding elements in this rank's shard of each flat parameter (fairscale name)."""
        return [h.spec.chunk - h.spec.valid for h in self.handles]

    @_option
    def params_with_grad(self) -> list[nn.Parameter]:
        """``[p for p in self.parameters() if p.grad is not None]``"""
        assert isinstance(self, nn.Module)
        return [p for p in self.parameters() if p.grad is not None]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters`` with fairscale's names: inside ``summon_full_params`` the
        original parameters under the plain module's names (no ``_fsdp_wrapped_module``); with
        ``flatten_parameters=False`` each parameter's shard under its original name. Outside, a flat
        parameter goes by the name its library gives it: fairscale's
        ``_fsdp_wrapped_module.flat_param_0`` (an inner wrapper's under
        ``_fsdp_wrapped_module._fpw_module.<path>.``), or torch FSDP1's
        ``_fsdp_wrapped_module._flat_param`` for a root built torch's way."""
        plain = self.training_state is TrainingState.SUMMON_FULL_PARAMS
        wrappers = self._wrappers() if recurse else [self]
        unflat = {
            id(h.flat_param): h.meta.fqns[0]
            for w in wrappers
            if not w.fsdp_config.sharding.flatten_parameters
            for h in w.handles
        }
        flat = {id(h.flat_param): i for w in wrappers for i, h in enumerate(w.handles)}
        module: Any = self
        named = nn.Module.named_parameters(module, prefix, recurse, remove_duplicate)
        if unflat and not plain:  # each shard where its parameter was, in module order (as fairscale)
            named = iter(sorted(named, key=self._module_order(prefix, unflat)))
        for name, p in named:
            if id(p) in unflat:  # (also inside a rank0_only summon, on the ranks that show no full ones)
                path = plain_name(name.rpartition(".")[0])
                yield (f"{path}." if path else "") + unflat[id(p)], p
            elif plain:
                yield plain_name(name), p
            elif id(p) in flat:
                yield self._flat_name(name.rpartition(".")[0], flat[id(p)]), p
            else:
                yield name, p

    def _module_order(self, prefix: str, unflat: dict[int, str]) -> Callable[[tuple[str, Any]], Any]:
        """A sort key putting each of ``named_parameters()``'s entries where the unwrapped model has it:
        the shard of an unflattened parameter at its module (in its registration order), anything
        else registered on a wrapper (flat parameters) just before that wrapper's module's own."""
        module: Any = self
        position: dict[str, int] = {}
        modules: dict[str, nn.Module] = {}
        for i, (n, m) in enumerate(nn.Module.named_modules(module, prefix=prefix)):
            position.setdefault(plain_name(n), i)
            modules[plain_name(n)] = m
        order = {id(m): names for w in self._wrappers() for m, names in w._module_param_order.items()}

        def key(item: tuple[str, Any]) -> tuple[int, int]:
            name, p = item
            path = plain_name(name.rpartition(".")[0])
            fqn = unflat.get(id(p))
            if fqn is None:
                return position.get(path, 0), -1
            owner, _, attr = f"{path}.{fqn}".strip(".").rpartition(".")
            names = order.get(id(modules.get(owner)), [])
            return position.get(owner, 0), names.index(attr) if attr in names else len(names)

        return key

    def _flat_name(self, path: str, index: int) -> str:
        """The name of flat parameter ``index`` of the wrapper at ``path`` (our module path, with
        ``_fsdp_wrapped_module`` levels) in the library this root was built for."""
        path = f"{path}." if path else ""
        if self._torch_options.torch_style:  # torch FSDP1 registers it on the wrapped module
            return f"{path}{WRAPPED}._flat_param" + (f"_{index}" if index else "")
        # fairscale: the FlattenParamsWrapper under each wrapper holds it, the module one level further
        return path.replace(f"{WRAPPED}.", f"{WRAPPED}._fpw_module.") + f"{WRAPPED}.flat_param_{index}"

    def get_parameter(self, target: str) -> nn.Parameter:
        """``nn.Module.get_parameter``, also for the names :meth:`named_parameters` gives that are not
        attribute paths: the original names of ``flatten_parameters=False`` (``use_orig_params``)
        shards, and the plain names inside ``summon_full_params``."""
        try:
            return nn.Module.get_parameter(self, target)  # type: ignore[arg-type]
        except AttributeError:
            for name, p in self.named_parameters(remove_duplicate=False):
                if name == target:
                    return p
            raise
