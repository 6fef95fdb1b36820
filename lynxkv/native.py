"""Deprecated: moved to :mod:`lynxkv.compiled`; importing from ``lynxkv.native`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.native is deprecated: import {name} from lynxkv.compiled", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("lynxkv.compiled"), name)
