"""lynxkv inside vLLM (``pip install "lynxkv[vllm]"``): compressed prefill -> decode KV transfer, and the speculative
gain through vLLM's public serving API.

- :mod:`~lynxkv.integrations.vllm.connector`: ``LynxConnector``, a KV connector loaded by module path. On a prefill
  instance it encodes each finished prompt's KV as a lynx cache in a store directory that it serves over HTTP
  (anchor ahead of residual); on a decode instance it loads a request's KV from such a URL, the anchor or the full
  code as the request asks.
- :mod:`~lynxkv.integrations.vllm.proxy`: ``lynxkv vllm-proxy``, the OpenAI-compatible ``/v1/completions`` endpoint
  in front of both instances that drafts on the anchor while the residual streams and verifies the drafts on the
  full code.
- :mod:`~lynxkv.integrations.vllm.paged` and :mod:`~lynxkv.integrations.vllm.fetch`: vLLM's paged KV layout and the
  decode side's shared loads (no vLLM import: tested without it).

docs/engines.md, "Lynx inside vLLM", shows the deployment.
"""
