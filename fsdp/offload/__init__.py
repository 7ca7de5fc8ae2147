"""``OffloadModel``: an ``nn.Sequential`` larger than the device, trained one slice at a time.

Owns: the public class (``model.py``), one slice of layers with its master copies
(``layer_slice.py``), and the schedule of copies and compute (``engine.py``).

Imports from: fsdp.api, fsdp.common.
"""
