"""``LynxConnector``: vLLM's KV connector for lynx caches, loaded by module path (vLLM's ``KVConnectorBase_V1``).

Configure it with ``--kv-transfer-config``::

    {"kv_connector": "LynxConnector", "kv_connector_module_path": "lynxkv.integrations.vllm.connector",
     "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config": {...}}

**Producer** (the prefill instance; extra config ``store``: a directory, ``port``, ``host``: where to serve it,
``url``: the address decode instances reach it at, default ``http://<host>:<port>``; ``dscp_anchor``,
``dscp_residual``: the DSCP classes of its responses, as ``lynxkv serve``'s options). A request whose
``kv_transfer_params`` carry ``{"lynx_publish": NAME}`` has its prompt's KV gathered from its blocks at the end of
the forward pass that completes its prompt, encoded with lynx's default scheme and written atomically as
``<store>/<NAME>.lynx`` (+ ``.lynxr``), before the request's output leaves the engine; its output's
``kv_transfer_params`` carry ``{"lynx_url": URL}``. The worker serves the directory (:class:`StoreServer`: anchor
ahead of residual, range requests), so the decode instance reads the anchor before the residual crosses the link.

**Consumer** (the decode instance; extra config ``sources``: the URL prefixes of the stores it may read, such as
``["http://prefill-host:7071/"]``, required; ``timeout_s``, default 120: how long a request waits for its KV;
``keep``, default 8: loads kept for reuse). A request naming a URL under no source is refused: a client of the
decode instance cannot make it fetch anything its operator did not name. A request whose ``kv_transfer_params``
carry ``{"lynx_url": URL, "lynx_mode": "anchor" | "full"}`` has its prompt's KV loaded asynchronously (it waits in vLLM's
``WAITING_FOR_REMOTE_KVS``) from that cache: the anchor as soon as it lands, or the full code once the residual is
in, dequantized into its blocks. Two requests naming one URL share one transfer (:mod:`.fetch`). A cache that does
not arrive in time, does not read, or was made from another prompt fails the load: vLLM's
``kv_load_failure_policy`` ("fail", its default, ends the request with an error) decides, never wrong tokens.

``{"lynx_verify": true}`` lets a request with ``prompt_logprobs`` read the prefix cache (vLLM skips it for such
requests, because it computes no logprobs for the positions it serves from there); the proxy's verify pass reads
only the positions it computes, the drafts'. A worker of either role makes the rows of positions not computed
zeros (token 0, logprob 0, rank 0) instead of the uninitialized memory vLLM leaves there, which its detokenizer
and its JSON encoder fail on (:func:`zero_uncomputed_prompt_logprobs`).

Keys of anchor and full-code KV never mix in vLLM's prefix cache because the proxy gives each request its own
``cache_salt`` (the block hashes chain from it).
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from lynxkv.cache.save import save_cache
from lynxkv.errors import LynxError
from lynxkv.integrations.vllm.fetch import MODES, SharedLoads
from lynxkv.integrations.vllm.paged import gather, layout_of, scatter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_LAYER = re.compile(r"\d+")


@dataclass
class LoadSpec:
    req_id: str
    url: str
    mode: str
    prompt: list[int]
    block_ids: list[int]
    start: int  # tokens already in the request's blocks (local prefix-cache hits): load from here


@dataclass
class SaveSpec:
    req_id: str
    name: str
    prompt: list[int]
    block_ids: list[int]


@dataclass
class LynxMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def zero_uncomputed_prompt_logprobs() -> None:
    """Make vLLM allocate its per-request prompt-logprob tensors zeroed (``LogprobsTensors.empty_cpu``): it fills
    the rows of the positions a request computes and returns the others as they were allocated."""
    from vllm.v1 import outputs

    original = outputs.LogprobsTensors.empty_cpu
    if getattr(original, "lynx_zeroed", False):
        return

    def empty_cpu(num_positions: int, num_tokens_per_position: int):
        tensors = original(num_positions, num_tokens_per_position)
        for t in (tensors.logprob_token_ids, tensors.logprobs, tensors.selected_token_ranks):
            t.zero_()
        return tensors

    empty_cpu.lynx_zeroed = True
    outputs.LogprobsTensors.empty_cpu = staticmethod(empty_cpu)


def _layer_index(name: str) -> tuple:
    return tuple(int(n) for n in _LAYER.findall(name)) or (0,)


class LynxConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        self._kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self._head_dim = model.get_head_size()
        self._producer = bool(cfg.is_kv_producer)
        self._timeout = float(extra.get("timeout_s", 120.0))
        self._store = extra.get("store")
        host, port = str(extra.get("host", "127.0.0.1")), int(extra.get("port", 7071))
        self._base_url = str(extra.get("url") or f"http://{host}:{port}").rstrip("/")
        if self._producer and not self._store:
            raise LynxError("LynxConnector: a producer needs kv_connector_extra_config.store (a directory)")
        sources = extra.get("sources") or []
        if isinstance(sources, str):
            sources = [sources]
        self._sources = tuple(str(s) for s in sources if str(s).startswith(("http://", "https://")))
        if not self._producer and not self._sources:
            raise LynxError("LynxConnector: a consumer needs kv_connector_extra_config.sources, the http(s) URL "
                            "prefixes of the stores it may read (e.g. [\"http://prefill-host:7071/\"])")
        # scheduler side
        self._to_load: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()
        self._to_save: dict[str, tuple[str, list[int], list[int]]] = {}  # req_id -> (name, block ids so far, prompt)
        # worker side
        self._layers: list[tuple[str, torch.Tensor, Any]] = []
        self._done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._loads: SharedLoads | None = None
        self._server = None
        if role == KVConnectorRole.WORKER:
            zero_uncomputed_prompt_logprobs()
            if self._producer:
                from lynxkv.serve.resources import parse_dscp
                from lynxkv.serve.store import StoreServer

                os.makedirs(self._store, exist_ok=True)
                self._server = StoreServer(self._store, host=host, port=port, dscp_anchor=parse_dscp(
                    extra.get("dscp_anchor")), dscp_residual=parse_dscp(extra.get("dscp_residual"))).start()
            else:
                self._loads = SharedLoads(keep=int(extra.get("keep", 8)))
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lynx-load")

    # ------------------------------------------------------------------ scheduler side
    @staticmethod
    def _params(request: "Request") -> dict:
        params = getattr(request, "kv_transfer_params", None)
        return params if isinstance(params, dict) else {}

    def on_new_request(self, request: "Request") -> None:
        if self._params(request).get("lynx_verify") is True:
            request.skip_reading_prefix_cache = False

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        if self._producer or "lynx_url" not in params or request.request_id in self._loaded:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        count = len(prompt) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = self._params(request)
        if num_external_tokens <= 0 or "lynx_url" not in params:
            return
        mode = params.get("lynx_mode", "full")
        url = params["lynx_url"]
        prompt = list(request.prompt_token_ids or [])
        self._loaded.add(request.request_id)
        self._to_load[request.request_id] = LoadSpec(
            request.request_id, str(url), str(mode), prompt, list(blocks.get_block_ids()[0]),
            len(prompt) - num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = LynxMetadata(loads=list(self._to_load.values()))
        self._to_load.clear()
        if not self._producer:
            return meta
        done: list[tuple[str, int]] = []  # (req_id, its tokens computed once this step has run)
        for new in scheduler_output.scheduled_new_reqs:
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") if new.sampling_params else None
            name = params.get("lynx_publish") if isinstance(params, dict) else None
            if isinstance(name, str) and NAME.fullmatch(name):
                self._to_save[new.req_id] = (name, list(new.block_ids[0]), list(new.prompt_token_ids or []))
                done.append((new.req_id, new.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._to_save:
                continue
            name, blocks, prompt = self._to_save[req_id]
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                blocks = list(new_ids[0]) if req_id in cached.resumed_req_ids else blocks + list(new_ids[0])
                self._to_save[req_id] = (name, blocks, prompt)
            done.append((req_id, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)))
        for req_id, computed in done:
            name, blocks, prompt = self._to_save[req_id]
            if prompt and computed >= len(prompt):
                meta.saves.append(SaveSpec(req_id, name, prompt, blocks))
                del self._to_save[req_id]
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loaded.discard(request.request_id)
        self._to_save.pop(request.request_id, None)
        name = self._params(request).get("lynx_publish")
        if self._producer and isinstance(name, str) and NAME.fullmatch(name):
            return False, {"lynx_url": f"{self._base_url}/{name}.lynx"}
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        layers = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        self._layers = [(name, t, layout_of(t, block_size=self._block_size, kv_heads=self._kv_heads,
                                           head_dim=self._head_dim)) for name, t in layers]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, LynxMetadata) or self._pool is None:
            return
        for spec in meta.loads:
            self._pool.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        try:
            if spec.mode not in MODES:
                raise LynxError(f"lynx_mode: expected one of {', '.join(MODES)}")
            if not spec.url.startswith(self._sources):
                raise LynxError(f"{spec.url[:200]}: not under a configured source ({', '.join(self._sources)})")
            kv = self._loads.kv(spec.url, spec.mode, spec.prompt, self._timeout)
            if len(kv) != len(self._layers):
                raise LynxError(f"{spec.url}: {len(kv)} layers, the model has {len(self._layers)}")
            first = spec.start // self._block_size  # the blocks before it hold local prefix-cache hits
            skip = first * self._block_size
            for (k, v), (_, tensor, layout) in zip(kv, self._layers):
                scatter(tensor, layout, spec.block_ids[first:], k[:, skip:], v[:, skip:])
        except Exception as exc:  # noqa: BLE001 - any failure fails this request's load, never the engine
            from vllm.logger import init_logger

            init_logger(__name__).warning("lynx: request %s: KV load failed: %s", spec.req_id, exc)
            with self._lock:
                self._failed_blocks.update(spec.block_ids)
        with self._lock:
            self._done.add(spec.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if not isinstance(meta, LynxMetadata) or not meta.saves:
            return
        for spec in meta.saves:
            kv = [gather(tensor, layout, spec.block_ids, len(spec.prompt)) for _, tensor, layout in self._layers]
            kv = [(k.cpu(), v.cpu()) for k, v in kv]
            save_cache(os.path.join(self._store, spec.name + ".lynx"), kv, prompt_token_ids=spec.prompt)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loads is not None:
            self._loads.close()
        if self._server is not None:
            self._server.close()
