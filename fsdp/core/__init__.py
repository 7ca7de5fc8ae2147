"""The data model: flat parameters, their shards and the handle that moves them between states.

Owns: shard arithmetic (``sharding.py``), deferred (meta-device) initialization
(``deferred_init.py``), the stand-ins of sharded parameters (``placeholders.py``), attributes set on
parameters and the parameters linked through them (``param_attrs.py``), flat-parameter metadata
(``flat_param.py``), gradient-readiness hooks
(``grad_hooks.py``), ``FlatParamHandle`` with its verbs shard / unshard / reshard (``handle.py``) and
reduce (``handle_grads.py``), the early release of the root's kept full parameters
(``saved_views.py``), NO_SHARD bucketing over handles (``no_shard_buckets.py``), the layout of a wrapped
model that state functions read (``layout.py``), and the typed ``Wrapper`` protocol through which
everything above sees a wrapper without importing it (``wrapper_protocol.py``).

Imports from: fsdp.api, fsdp.common, fsdp.comm.
"""
