"""Built-in prompts made from offline text (CPython's ``pydoc_data.topics``), so every command has a default.

The text is English reference documentation that ships with every CPython, about 465K characters; prompts are
cut from it deterministically by token count, so the same call always yields the same prompt.
"""

from __future__ import annotations

from functools import lru_cache

QUESTION = "\n\nQuestion: In two sentences, what is the main point of the documentation above?\nAnswer:"


@lru_cache(maxsize=1)
def corpus_sections() -> list[tuple[str, str]]:
    """(topic, text) pairs of pydoc's topic help, sorted by topic name."""
    from pydoc_data.topics import topics

    return sorted((k, v.strip()) for k, v in topics.items() if v.strip())


def document(start: int = 0, min_chars: int = 4000) -> str:
    """Concatenated topic texts starting at section ``start`` (wrapping around) of at least ``min_chars``."""
    sections = corpus_sections()
    parts: list[str] = []
    size = 0
    i = start % len(sections)
    while size < min_chars:
        name, text = sections[i]
        parts.append(f"## {name}\n\n{text}")
        size += len(parts[-1]) + 2
        i = (i + 1) % len(sections)
    return "\n\n".join(parts)


def builtin_prompt(tokenizer, tokens: int = 1000, *, start: int = 0) -> str:
    """A prompt of about ``tokens`` tokens: documentation text followed by a question about it."""
    text = document(start, min_chars=tokens * 6)
    ids = tokenizer(text).input_ids
    budget = max(tokens - len(tokenizer(QUESTION).input_ids), 1)
    doc = tokenizer.decode(ids[:budget], skip_special_tokens=True)
    return doc + QUESTION
