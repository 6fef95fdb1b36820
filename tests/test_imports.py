"""The package's import graph: no cycles among lynxkv modules, the layers' arrows pointing down, and every module
importable on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "lynxkv"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """lynxkv modules that ``name`` imports anywhere in its source (lazy imports inside functions included);
    ``from pkg import submodule`` depends on the submodule, not on the package."""
    out = set()
    for n in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.startswith("lynxkv"):
            subs = [f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in MODULES]
            out.update(subs)
            if len(subs) < len(n.names):
                out.add(n.module)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("lynxkv"))
    return {m for m in out if m in MODULES and m != name}


GRAPH = {m: _imports(m) for m in MODULES}


def _cycle_from(start: str) -> list[str] | None:
    path, seen = [], set()

    def walk(m: str) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in seen:
            return None
        seen.add(m)
        path.append(m)
        for d in sorted(GRAPH[m]):
            found = walk(d)
            if found:
                return found
        path.pop()
        return None

    return walk(start)


def test_no_import_cycle_among_lynxkv_modules():
    for m in sorted(GRAPH):
        cycle = _cycle_from(m)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    GRAPH["lynxkv.storage"].add("lynxkv.cache")  # cache imports storage: this closes a loop
    try:
        assert _cycle_from("lynxkv.cache") is not None
    finally:
        GRAPH["lynxkv.storage"].discard("lynxkv.cache")


@pytest.mark.parametrize("low, high", [
    ("lynxkv.format", "lynxkv.storage"),  # the format is bytes only: it opens nothing
    ("lynxkv.format", "lynxkv.cache"),
    ("lynxkv.format", "lynxkv.stream"),
    ("lynxkv.storage", "lynxkv.hf"),  # storage knows nothing of models, formats or the CLI
    ("lynxkv.storage", "lynxkv.format"),
    ("lynxkv.storage", "lynxkv.cache"),
    ("lynxkv.format", "lynxkv.hf"),
    ("lynxkv.quant", "lynxkv.format"),  # the quantizer works on tensors: no bytes, files or models
    ("lynxkv.quant", "lynxkv.storage"),
    ("lynxkv.quant", "lynxkv.cache"),
    ("lynxkv.quant", "lynxkv.hf"),
    ("lynxkv.storage", "lynxkv.quant"),
    ("lynxkv.cache", "lynxkv.stream"),
    ("lynxkv.cache", "lynxkv.hf"),
    ("lynxkv.stream", "lynxkv.hf"),
    ("lynxkv.stream", "lynxkv.speculative"),
    ("lynxkv.stream", "lynxkv.serve"),  # the server reads through the layers below it; nothing there serves
    ("lynxkv.cache", "lynxkv.serve"),  # the runner sits above the transports, not beside them
    ("lynxkv.speculative", "lynxkv.stream"),  # it consumes a lynxkv.loading.CacheLoad, whichever transport
    ("lynxkv.hf", "lynxkv.speculative"),
    ("lynxkv.hf", "lynxkv.stream"),
    ("lynxkv", "lynxkv.cli"),  # nothing in the library imports the CLI
])
def test_imports_point_down(low, high):
    def within(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    for m, deps in GRAPH.items():
        if within(m, low) and not within(m, high) and m != "lynxkv.__main__":
            bad = sorted(d for d in deps if within(d, high))
            assert not bad, f"{m} imports {bad}"


@pytest.mark.parametrize("top, importers", [
    ("lynxkv.eval", ("lynxkv.cli",)),  # evaluation sits on top of the library; only its command imports it
    ("lynxkv.integrations", ("lynxkv.cli",)),  # optional extras, loaded by their hosts (LMCache) or a command
    ("lynxkv.bench", ("lynxkv.cli",)),  # tooling beside the product (--compare, --timeline): the reader and the engine never import it
])
def test_top_layers_are_imported_from_above_only(top, importers):
    for m, deps in GRAPH.items():
        if m == top or m.startswith(top + ".") or any(m == i or m.startswith(i + ".") for i in importers):
            continue
        bad = sorted(d for d in deps if d == top or d.startswith(top + "."))
        assert not bad, f"{m} imports {bad}"


def test_every_module_imports_on_its_own():
    """Each module in a fresh interpreter, in an order where every lynxkv module it imports comes first."""
    order, done = [], set()

    def visit(m: str) -> None:
        if m in done:
            return
        done.add(m)
        for d in sorted(GRAPH[m]):
            visit(d)
        order.append(m)

    for m in sorted(GRAPH):
        visit(m)
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    skip = {m for m in order if m.startswith("lynxkv.kernels") or m == "lynxkv.__main__"}  # Triton; runs the CLI
    import importlib.util

    extras = {"lynxkv.integrations.lmcache.serde": "lmcache", "lynxkv.integrations.lmcache.adapter": "lmcache",
              "lynxkv.integrations.vllm.connector": "vllm"}
    skip |= {m for m, dep in extras.items() if importlib.util.find_spec(dep) is None}  # an optional extra
    proc = subprocess.run([sys.executable, "-c", code, *[m for m in order if m not in skip]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_two_modules_share_a_file_name():
    """One meaning per name: ``report.py`` in two packages reads as one concept; ``__init__.py`` excepted."""
    seen: dict[str, list[str]] = {}
    for p in [*ROOT.rglob("*.py"), *(ROOT.parent / "kernels").rglob("*.py")]:  # rglob does not follow lynxkv/kernels
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(str(p.relative_to(ROOT.parent)))
    twice = {n: ps for n, ps in seen.items() if len(ps) > 1}
    assert not twice, f"file names used twice: {twice}"


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists packages explicitly: a new subpackage must be listed, or a built wheel silently leaves it
    out while an editable install still finds it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "lynxkv").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's package list: {sorted(found - listed)}"


def test_the_checkout_does_not_shadow_hugging_faces_kernels_package():
    """From the repository's root, ``python -c`` puts the root first on sys.path. ``kernels`` there must still be
    Hugging Face's package (transformers imports it), never this checkout's top-level kernels/ directory."""
    root = ROOT.parent
    code = ("from transformers.integrations import hub_kernels\n"
            "from transformers import LlamaConfig\n"
            "import kernels\n"
            "print(getattr(kernels, '__file__', None))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = proc.stdout.strip().splitlines()[-1]
    assert found == "None" or not pathlib.Path(found).resolve().is_relative_to(root / "kernels"), found


