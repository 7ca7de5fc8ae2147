"""apex-style data parallelism: replicated parameters, learned gradient buckets all-reduced in
backward (``data_parallel.py``).

Imports from: fsdp.api, fsdp.common, fsdp.comm.
"""
