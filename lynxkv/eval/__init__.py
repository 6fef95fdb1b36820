"""Offline evaluation of KV-cache codecs: metrics, baselines, draft quality, reports (``lynxkv eval``)."""
