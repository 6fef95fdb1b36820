"""Benchmark and test tooling beside the product: network lab, link emulation, baselines. The reader and the engine never import it."""
