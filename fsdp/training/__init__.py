"""What a training loop uses beside the wrapper.

Owns: activation checkpointing (``activation_checkpoint.py``, with its eager half
``recompute.py``; neither imports the wrapper), the optimizer step inside backward
(``optim_in_backward.py``) and the sharded gradient scaler (``sharded_grad_scaler.py``).

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core, fsdp.wrapper.
"""
