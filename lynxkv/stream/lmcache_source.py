"""Deprecated: moved to :mod:`lynxkv.integrations.lmcache.source`; importing from ``lynxkv.stream.lmcache_source`` still works and warns."""

import importlib
import warnings


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"lynxkv.stream.lmcache_source is deprecated: import {name} from "
                  "lynxkv.integrations.lmcache.source", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("lynxkv.integrations.lmcache.source"), name)
