"""Deprecated: moved to :mod:`lynxkv.serve`; importing from ``lynxkv.stream.http_server`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.stream.http_server is deprecated: import {name} from lynxkv.serve", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("lynxkv.serve"), name)
