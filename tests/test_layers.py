"""The package's architecture, checked: imports point down the layers only, and the bottom layer imports no ML
framework."""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "transduce")

# Lowest first. A module belongs to the entry with the longest matching prefix; it may import its own layer and
# the layers below it, never one above (at module level or inside a function).
LAYERS = [
    ("formats", ("transduce", "transduce.errors", "transduce.formats", "transduce.cli_errors", "transduce._console")),
    ("models", ("transduce.models", "transduce.tokenizer")),
    ("runtime", ("transduce.runtime",)),
    ("verification", ("transduce.verify",)),
    ("training, export, build", ("transduce.training", "transduce.exporter", "transduce.build")),
    ("inspect, bench, serve", ("transduce.inspect", "transduce.bench", "transduce.demo", "transduce.serve")),
    ("cli", ("transduce.cli",)),
]
FRAMEWORKS = ("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "tokenizers", "safetensors", "ctranslate2",
              "sentencepiece", "transformers", "numpy", "click", "rich")


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def _layer(module: str) -> tuple[int, str]:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    assert best is not None, module
    return best


def _imports(path: str, module: str):
    """(imported module, line) for every import in the file, at any depth; relative imports resolved."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for a in node.names:  # `from transduce.formats import contract` imports transduce.formats.contract
                yield (f"{base}.{a.name}" if base.startswith("transduce") else base), node.lineno


def test_imports_point_down_the_layers():
    wrong = []
    for module, path in _modules():
        layer, _ = _layer(module)
        for target, line in _imports(path, module):
            if target.split(".")[0] != "transduce":
                continue
            t_layer, _ = _layer(target)
            if t_layer > layer:
                wrong.append(f"{os.path.relpath(path, PACKAGE)}:{line}: {module} ({LAYERS[layer][0]}) imports "
                             f"{target} ({LAYERS[t_layer][0]})")
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_packages_of_one_layer_do_not_import_each_other_in_a_circle():
    edges: dict[str, set[str]] = {}
    for module, path in _modules():
        layer, own = _layer(module)
        for target, _ in _imports(path, module):
            if target.split(".")[0] == "transduce":
                t_layer, other = _layer(target)
                if t_layer == layer and other != own:
                    edges.setdefault(own, set()).add(other)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if reaches(b, a, {b}))
    assert not cycles, cycles


def test_the_formats_layer_imports_no_framework():
    found = []
    for module, path in _modules():
        if _layer(module)[0] != 0:
            continue
        for target, line in _imports(path, module):
            if (target.split(".")[0] in FRAMEWORKS
                    and not module.startswith(("transduce.cli_errors", "transduce._console"))):
                found.append(f"{os.path.relpath(path, PACKAGE)}:{line}: {target}")
    assert not found, found


@pytest.mark.parametrize("bad", ["transduce.exporter.onnx_export", "transduce.cli"])
def test_the_import_check_can_fail(bad):
    """A runtime module importing the exporter (or the CLI) is the kind of import the check refuses."""
    assert _layer(bad)[0] > _layer("transduce.runtime.api")[0]
