"""``lynxkv encode / decode / inspect / verify``."""
