"""lynxkv as an LMCache storage format and tier (``pip install "lynxkv[lmcache]"``, tested with LMCache 0.5.6).

- ``chunk``: one LMCache chunk (``[2, layers, 256, kv_heads*head_dim]``) as lynx bytes and back; plain lynxkv.
- ``serde``: the ``lynx`` serde (importing it registers it with LMCache).
- ``source``: the ``lmcache://`` transport: a prompt's stored prefix read progressively from the tier's objects.
- ``adapter``: ``LynxL2Adapter``, the plugin tier keeping each chunk's anchor and residual as separate objects on
  separate paths, a corrupted object a miss for its chunk only.

The exact ``lmcache server`` command line is in docs/engines.md.
"""
