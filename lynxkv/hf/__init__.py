"""The Hugging Face side: model loading, prompts, prefill and conversion to and from ``transformers`` caches."""
