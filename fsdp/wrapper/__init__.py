"""The wrapper: ``FullyShardedDataParallel`` and the methods mixed into it.

Owns: the class (``fully_sharded.py``) and what runs in a step (``base.py``: state machine, lazy
init, forward, backward hooks), its construction (``construct.py``, ``torch_compat.py``),
the root's shared context (``root_context.py``), mixed precision (``mixed_precision.py``), ties
across wrappers (``shared_params.py``), gradient clipping (``clip_grad.py``), and one mixin per
group of methods (``*_methods.py``, ``fairscale_attrs.py``, ``direct_call.py``, ``module_ops.py``),
plus ``auto_wrap_bn`` (``norm_wrap.py``). Each mixin sees the wrapper through
``fsdp.core.wrapper_protocol.Wrapper``.

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core, fsdp.state, fsdp.wrap.
"""
