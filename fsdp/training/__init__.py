"""What a training loop uses beside the wrapper.

Owns: activation checkpointing (``activation_checkpoint.py``, with its eager half
``recompute.py``; neither imports the wrapper), the optimizer step inside backward
(``optim_in_backward.py``), the sharded gradient scaler (``sharded_grad_scaler.py``) and the
estimate of a rank's peak memory before a job (``memory_estimate.py``) with the tracker it measures
with (``memory_tracker.py``, imported only when used: torch's trackers import sympy).

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core, fsdp.wrapper.
"""
