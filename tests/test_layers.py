"""The package's import graph has no cycles and no import from a lower layer to a higher one.

Every module of ``cosyserve`` is parsed with ``ast`` (nothing is imported). An edge is any import of
a ``cosyserve`` module, absolute or relative, at module level or inside a function or an
``if TYPE_CHECKING:`` block: ``from .x import y`` is an edge to ``x`` and, when ``x.y`` is a module,
to ``x.y`` too. A package's ``__init__`` is the module of the package's own name.

The rule: a module imports only modules of its own layer or of the layers below it, and no chain
of imports leads back to where it started. A module's layer is that of its top-level name under
``cosyserve`` (``cosyserve.llm.engine.sequence`` -> ``llm``). The layers, lowest first:

0. leaves: ``errors``, ``config``, ``runtime`` (bundle layout, device helpers), ``schedule`` (chunk
   schedules), ``clip_cache`` and the root ``cosyserve`` package;
1. ``audio``;
2. what turns audio or text into model inputs, and the models: ``frontend``, ``text`` (text
   normalisation), ``models``, ``data`` (synthesis items; reads audio);
3. ``token2wav``, ``llm`` (with ``llm.trtllm``);
4. ``engine`` (the engine core: every request of a GPU in one loop, and what a request is before
   it runs: ``engine.front_end``);
5. entry points and tools over the whole stack: ``serving``, ``api``, ``bench``, ``clients``,
   ``offline`` (offline_inference.py's batches), and the tools that build, fetch or check models
   (``bundle``, ``download``, ``parity``): they use the stack, the stack never uses them.

A new top-level name must be given a layer here before it can be imported anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "cosyserve"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"", "errors", "config", "runtime", "schedule", "clip_cache", "speech_tokens", "lru"}),  # "": cosyserve/__init__.py
    frozenset({"audio"}),
    frozenset({"frontend", "text", "models", "data"}),
    frozenset({"token2wav", "llm"}),
    frozenset({"engine"}),
    frozenset({"serving", "api", "bench", "clients", "offline", "bundle", "download", "parity"}),
)

def package_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name under ``cosyserve`` ("" for the root) -> (file, is a package ``__init__``)."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path, is_package)
    return modules


def _dotted(*names: str) -> str:
    return ".".join(name for name in names if name)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its file)."""
    modules = package_modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    if node.level - 1 > len(base):
                        raise AssertionError(f"{path}: relative import above the package")
                    base = base[:len(base) - (node.level - 1)]
                    source = _dotted(*base, node.module or "")
                    candidates = [f"cosyserve.{source}" if source else "cosyserve"]
                else:
                    candidates = [node.module or ""]
                candidates += [f"{candidates[0]}.{alias.name}" for alias in node.names]
            else:
                continue
            for candidate in candidates:
                if candidate == "cosyserve" or candidate.startswith("cosyserve."):
                    target = candidate.removeprefix("cosyserve").removeprefix(".")
                    if target in modules and target != name:
                        targets.add(target)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int:
    name = module.partition(".")[0]
    for rank, names in enumerate(LAYERS):
        if name in names:
            return rank
    raise AssertionError(f"cosyserve.{module}: its top-level name {name!r} has no layer; add it to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_parser_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert "text" in graph["engine.front_end"]  # from ..text import MAX_SEGMENT_CHARS, ...
    assert "errors" in graph["data"]  # from .errors import InvalidInputError
    assert "audio.io" in graph["data"]  # inside load_reference_audio
    assert "bundle.step_audio2" in graph["bundle"]  # from .step_audio2 import make_step_audio2_dir, inside make_bundle
    assert "llm.base" in graph["llm.trtllm"]  # from ..base import BackendUnavailableError


def test_every_module_has_a_layer():
    for module in package_modules():
        layer_of(module)


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_imports_go_down_the_layers():
    back_edges = [f"cosyserve.{source} (layer {layer_of(source)}) imports cosyserve.{target} (layer {layer_of(target)})"
                  for source, targets in sorted(import_graph().items()) for target in sorted(targets)
                  if layer_of(target) > layer_of(source)]
    assert back_edges == []
