"""Deprecated: moved to :mod:`lynxkv.cache.loading`; importing from ``lynxkv.loading`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.loading is deprecated: import {name} from lynxkv.cache.loading", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("lynxkv.cache.loading"), name)
