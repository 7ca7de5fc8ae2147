"""Runnable examples. Run them as modules from the repository root, which puts the checkout's
``fsdp`` and ``examples`` packages on the path without installing anything::

    python3 -m examples.train_gpt --help
    torchrun --standalone --nproc_per_node=2 -m examples.train_gpt
    torchrun --standalone --nproc_per_node=2 -m examples.finetune_hf   # needs the "hf" extra
"""
