"""Wrapping policies: ``enable_wrap`` / ``wrap`` / ``auto_wrap`` and the policies that pick modules.

The public face is this package (``from fsdp.wrap import ...``), as in fairscale 0.4.13; the code is
in ``policies.py`` (the policies) and ``context.py`` (the context and the walk). Never imports the
wrapper: ``wrap`` builds whatever wrapper class the ``enable_wrap`` context names.

Imports from: fsdp.api, fsdp.common, fsdp.comm, fsdp.core.
"""

from fsdp.wrap.context import auto_wrap, enable_wrap, wrap, wrap_children
from fsdp.wrap.policies import (
    AutoWrapPolicy,
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    is_torch_style,
    lambda_auto_wrap_policy,
    no_split_modules_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

# pickles of 0.1.0 name these classes under fsdp.wrap
from fsdp.wrap.policies import _ClassNamePolicy as _ClassNamePolicy
from fsdp.wrap.policies import _LambdaPolicy as _LambdaPolicy
from fsdp.wrap.policies import _ModuleTypePolicy as _ModuleTypePolicy

__all__ = [
    "AutoWrapPolicy",
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "is_torch_style",
    "lambda_auto_wrap_policy",
    "no_split_modules_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
    "wrap_children",
]
