"""lynxkv as an LMCache serde, storage tier and ``lmcache://`` source (``pip install "lynxkv[lmcache]"``)."""
