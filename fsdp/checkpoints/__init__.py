"""Checkpoint directories on disk: save and load at any world size, integrity, application state.

Owns: ``save_checkpoint`` / ``load_checkpoint`` / ``latest_checkpoint`` (``save_load.py``), the
commit marker, checksums and verification (``files.py``), and every rank's training-loop state
(``app_state.py``). The in-memory forms it writes are ``fsdp.state``'s; offline consolidation is
``fsdp.consolidate`` (``python -m fsdp.consolidate``).

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core, fsdp.state, fsdp.wrapper.
"""
