"""State dicts and optimizer state of a wrapped model, in memory.

Owns: local state dicts (``local.py``), the full, sharded and plain-parent state dicts
(``state_dict.py``), optimizer state per original parameter, gathered (``optim_state.py``) and sharded
(``optim_sharded.py``), fairscale's form of a gathered optimizer state (``optim_fairscale.py``), and
state dicts given in place of the optimizer's own or keyed by name (``optim_given.py``).
Works on a ``fsdp.core.layout.Layout`` and on wrappers typed as ``fsdp.core.wrapper_protocol.Wrapper``;
never imports the wrapper. Files on disk are ``fsdp.checkpoints``.

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core.
"""
