"""lynxkv inside the serving stacks people already run, each an optional extra (``lynxkv[lmcache]``)."""
