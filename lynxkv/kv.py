"""Deprecated: moved to :mod:`lynxkv.cache.kv`; importing from ``lynxkv.kv`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.kv is deprecated: import {name} from lynxkv.cache.kv", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("lynxkv.cache.kv"), name)
