"""The text the accuracy tasks read: English prose that had no part in choosing any default.

By default it is the **docstrings** (module, class and function documentation of at least
:data:`MIN_DOCSTRING` characters) of :data:`PROSE_MODULES`, CPython standard-library modules, read from this
interpreter's standard library with :mod:`ast` (nothing is imported): about 400K characters of English. It is
neither the choosing corpus (pydoc's topic help, :mod:`lynxkv.hf.prompts`) nor the source of the modules whose
code is the draft evaluation's held-out corpus (:data:`lynxkv.eval.cases.STDLIB_MODULES`, none of which is listed
here). ``--corpus DIR`` reads every ``*.txt``, ``*.md`` and ``*.rst`` file under a directory instead.

Either way the text is tokenized once and every run of :data:`~lynxkv.eval.cases.OVERLAP_TOKENS` tokens it shares
with the choosing corpus is cut out (:func:`clean_ids`), so no document or filler repeats text a default was
chosen on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lynxkv.errors import InputError
from lynxkv.eval.cases import OVERLAP_TOKENS, choosing_runs

#: Standard-library modules whose docstrings are the default task corpus (prose-rich, sorted by name; none of
#: :data:`lynxkv.eval.cases.STDLIB_MODULES`). A module missing from an interpreter is left out.
PROSE_MODULES = (
    "_pydecimal", "calendar", "cmd", "collections/__init__", "concurrent/futures/_base", "configparser",
    "contextlib", "csv", "datetime", "difflib", "doctest", "enum", "fnmatch", "fractions", "getopt", "gettext",
    "glob", "hashlib", "heapq", "http/client", "http/cookiejar", "imaplib", "ipaddress", "locale",
    "logging/__init__", "mailbox", "multiprocessing/pool", "optparse", "os", "pickle", "platform", "pprint",
    "queue", "random", "sched", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3/__init__", "ssl",
    "statistics", "string", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "turtle", "unittest/case", "unittest/mock", "urllib/request", "uuid", "warnings", "wave", "weakref",
    "webbrowser", "xml/dom/minidom", "zipimport",
)  # fmt: skip

#: Shorter docstrings (one-line summaries) are left out: they are labels, not prose.
MIN_DOCSTRING = 300

#: Files ``--corpus DIR`` reads.
CORPUS_SUFFIXES = (".txt", ".md", ".rst")


@dataclass(frozen=True)
class TaskCorpus:
    """Text the tasks cut documents and filler from."""

    name: str  # what the text is, printed with every table
    text: str


def docstring_text() -> str:
    """The docstrings of :data:`PROSE_MODULES`, in that order and each module's in source order, joined by blank
    lines."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in PROSE_MODULES:
        path = root / f"{name}.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                               ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING:
                parts.append(doc.strip())
    return "\n\n".join(parts)


def default_corpus() -> TaskCorpus:
    text = docstring_text()
    if not text:
        raise InputError("task corpus: no standard-library docstrings found; give --corpus DIR")
    return TaskCorpus(f"docstrings of {len(PROSE_MODULES)} Python standard-library modules (English prose)", text)


def directory_corpus(directory: str) -> TaskCorpus:
    """Every ``*.txt``, ``*.md`` and ``*.rst`` file under ``directory`` (sorted by path), joined by blank lines.
    A missing directory, or one holding no such non-empty file, is one clear error."""
    root = Path(directory)
    if not root.is_dir():
        raise InputError(f"--corpus: {directory} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES)
    parts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--corpus: cannot read {path} as UTF-8 text ({exc})") from None
        if text:
            parts.append(text)
    if not parts:
        raise InputError(f"--corpus: {directory} holds no non-empty {', '.join(CORPUS_SUFFIXES)} file")
    return TaskCorpus(f"{len(parts)} text file(s) under {directory}", "\n\n".join(parts))


def clean_ids(tokenizer, corpus: TaskCorpus, avoid: set[int] | None = None) -> tuple[list[int], int]:
    """The corpus's token ids with every run of :data:`OVERLAP_TOKENS` tokens shared with the choosing corpus
    removed (``avoid``: those runs' hashes, computed when not given), and how many tokens were removed."""
    ids = tokenizer(corpus.text).input_ids
    if avoid is None:
        avoid = choosing_runs(tokenizer)
    n = OVERLAP_TOKENS
    drop = bytearray(len(ids))
    for i in range(len(ids) - n + 1):
        if hash(tuple(ids[i : i + n])) in avoid:
            drop[i : i + n] = b"\x01" * n
    kept = [t for t, d in zip(ids, drop) if not d]
    return kept, len(ids) - len(kept)
