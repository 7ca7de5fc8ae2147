"""Leaf helpers that know nothing of sharding.

Owns: the device (``device.py``, the only module of the library that names ``torch.cuda``: streams,
events, pinned memory), ``torch.compile`` support (``torch_compile.py``), walking nests of module
outputs (``nest.py``), the process-wide misuse guards (``guards.py``), and what a memory tracker is told
about the wrapper's tensors (``memory_tags.py``).

Imports from: nothing else in fsdp.
"""
