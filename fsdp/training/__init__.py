"""What a training loop uses beside the wrapper.

Owns: activation checkpointing (``activation_checkpoint.py``, with its eager half
``recompute.py``; neither imports the wrapper) and the sharded gradient scaler
(``sharded_grad_scaler.py``).

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core, fsdp.wrapper.
"""
