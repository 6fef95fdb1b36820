"""lynxkv inside the serving stacks people already run. Each integration is an optional extra:
``lynxkv.integrations.lmcache`` (``pip install "lynxkv[lmcache]"``)."""
