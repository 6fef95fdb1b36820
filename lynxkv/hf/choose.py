"""The anchor chosen for the cache it encodes: each candidate scheme's anchor is tried on the cache's own pages,
and the one whose drafts the model scores closest to the exact cache is written.

Why. The anchor's layout that drafts best is a property of the model, not of quantization alone: on SmolLM2 the keys
rotated by a Walsh–Hadamard matrix halve the anchor's next-token KL, on Gemma 3 they double it, although the keys'
mean squared error is the same within 3% either way (docs/evaluation.md, "The anchor chosen per cache"). No
statistic of the keys alone predicts the sign (the keys standing in for the queries favour the rotation on every
layer of both models), so the choice asks the model.

How (:func:`choose_scheme`). The last ``probe`` tokens of the prompt are held out: the cache of the tokens before
them is round-tripped through each candidate's anchor alone, and one forward of the held-out tokens on it is
compared with the same forward on the exact cache (mean next-token KL over the ``probe`` positions, the exact
distribution first). The candidate with the lowest KL wins; a tie, or a prompt too short to probe, keeps the
first candidate (the default). The cost is ``1 + len(candidates)`` forwards of ``probe`` tokens and one
quantization of the cache per candidate; a prefill of the prompt costs far more.

Every candidate is a valid scheme of the format (:data:`CANDIDATES` differ in the keys' rotation alone, a field of
the anchor header), so every reader, kernel and tier decodes the chosen one unchanged.
A cache encoded without a model (a tensor dump) takes the scheme it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynxkv.cache.kv import KVPairs
from lynxkv.quant import dequantize, quantize
from lynxkv.quant.scheme import DEFAULT, PLAIN_KEYS, Scheme

#: The candidates, the default first (its keys rotated), then the same scheme with the keys as they are (the
#: ``plain-keys`` preset).
CANDIDATES: tuple[Scheme, ...] = (DEFAULT, PLAIN_KEYS)
#: The candidates' preset names, in order.
LABELS = ("default", "plain-keys")

#: Held-out prompt tokens the candidates are scored on.
PROBE_TOKENS = 32

#: A prompt needs this many tokens before the probe for the choice to be made (shorter: the first candidate).
MIN_CONTEXT = 64


@dataclass(frozen=True)
class Choice:
    """The chosen scheme and what each candidate scored (``kl[i]`` for ``candidates[i]``; empty when the prompt was
    too short to probe)."""

    scheme: Scheme
    candidates: tuple[Scheme, ...]
    kl: tuple[float, ...]
    probe_tokens: int

    @property
    def labels(self) -> tuple[str, ...]:
        """The candidates' names: their presets' (:data:`LABELS`) where they are :data:`CANDIDATES`."""
        def same(a: Scheme, b: Scheme) -> bool:  # what the candidates differ in
            return (a.compander, a.alpha, a.key_rotation) == (b.compander, b.alpha, b.key_rotation)

        if len(self.candidates) == len(CANDIDATES) and all(map(same, self.candidates, CANDIDATES)):
            return LABELS
        return tuple(f"candidate {i}" for i in range(len(self.candidates)))

    def to_dict(self) -> dict:
        return {"scheme": self.scheme.describe(), "chosen": self.labels[self.candidates.index(self.scheme)],
                "probe_tokens": self.probe_tokens,
                "candidates": [{"name": n, "scheme": s.describe(), "kl": k}
                               for n, s, k in zip(self.labels, self.candidates, self.kl or (None,) * len(self.candidates))]}


def anchor_roundtrip(kv: KVPairs, scheme: Scheme) -> KVPairs:
    """Every layer's keys and values as the anchor of ``scheme`` alone decodes them, in their own dtype."""
    return [tuple(dequantize(quantize(t, scheme, kind), scheme, anchor_only=True, dtype=t.dtype)
                  for t, kind in ((k, "key"), (v, "value"))) for k, v in kv]  # type: ignore[misc]


@torch.no_grad()
def choose_scheme(model: torch.nn.Module, input_ids: torch.Tensor, kv: KVPairs,
                  candidates: tuple[Scheme, ...] = CANDIDATES, *, probe: int = PROBE_TOKENS) -> Choice:
    """The candidate whose anchor, on the cache ``kv`` of the prompt ``input_ids`` (``[T]``; ``kv`` per layer
    ``[H, T, D]``, as :func:`lynxkv.hf.prefill` returns it), drafts closest to the exact cache (module docstring)."""
    from lynxkv.hf.convert import kv_to_cache
    from lynxkv.hf.prefill import forward

    ids = input_ids.reshape(-1)
    tokens = ids.numel()
    if len(candidates) < 2 or tokens < MIN_CONTEXT + probe:
        return Choice(candidates[0], tuple(candidates), (), 0)
    keep = tokens - probe
    context = [(k[:, :keep], v[:, :keep]) for k, v in kv]
    inputs = ids[keep:].reshape(1, -1).to(model.device)

    def log_probs(pairs: KVPairs) -> torch.Tensor:
        out = forward(model, inputs, kv_to_cache(pairs, dtype=model.dtype))
        return torch.log_softmax(out.logits[0].float(), dim=-1)

    exact = log_probs(context)
    p = exact.exp()
    kl = []
    for scheme in candidates:
        approx = log_probs(anchor_roundtrip(context, scheme))
        kl.append(float((p * (exact - approx)).sum(-1).mean()))
    best = min(range(len(candidates)), key=lambda i: (kl[i], i))
    return Choice(candidates[best], tuple(candidates), tuple(kl), probe)
