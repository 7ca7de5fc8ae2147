"""Benchmarks and checks of the library, run as modules from the repository root, e.g.
``torchrun --standalone --nproc_per_node=2 -m benchmarks.peers`` (see docs/performance.md)."""
