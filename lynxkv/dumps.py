"""Deprecated: moved to :mod:`lynxkv.cache.dumps`; importing from ``lynxkv.dumps`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.dumps is deprecated: import {name} from lynxkv.cache.dumps", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("lynxkv.cache.dumps"), name)
