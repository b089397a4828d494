"""The package's architecture, checked: imports point down the layers only, the bottom layer imports no ML
framework, and modules and functions stay small enough to read (or say at their top why not)."""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "transduce")

# Lowest first. A module belongs to the entry with the longest matching prefix; it may import its own layer and
# the layers below it, never one above (at module level or inside a function).
LAYERS = [
    ("io", ("transduce", "transduce.errors", "transduce.io", "transduce._console")),
    ("formats", ("transduce.formats",)),
    ("models", ("transduce.models",)),
    ("runtime", ("transduce.runtime",)),
    ("verification", ("transduce.verify",)),
    ("training, export, build", ("transduce.training", "transduce.exporter", "transduce.build",
                                 "transduce.importers")),
    ("inspect, bench, serve", ("transduce.inspect", "transduce.bench", "transduce.demo", "transduce.serve")),
    ("cli", ("transduce.cli",)),
]
FRAMEWORKS = ("torch", "onnx", "onnxruntime", "onnxscript", "tensorrt", "tokenizers", "safetensors", "ctranslate2",
              "sentencepiece", "transformers", "numpy", "click", "rich")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100
LONG_MARK = "# long:"  # a module's or function's first comment line saying why it is longer


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


def _upward_imports(modules) -> list[str]:
    """Every import, at any depth, of a `transduce` module from a layer above the importing module's."""
    wrong = []
    for module, path in modules:
        layer, _ = _layer(module)
        for target, line in _imports(path, module):
            if target.split(".")[0] != "transduce":
                continue
            t_layer, _ = _layer(target)
            if t_layer > layer:
                wrong.append(f"{os.path.basename(path)}:{line}: {module} ({LAYERS[layer][0]}) imports "
                             f"{target} ({LAYERS[t_layer][0]})")
    return wrong


def test_imports_point_down_the_layers():
    wrong = _upward_imports(_modules())
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


def test_the_io_and_formats_layers_import_no_framework():
    found = []
    for module, path in _modules():
        if _layer(module)[0] > 1:  # io and formats
            continue
        for target, line in _imports(path, module):
            if (target.split(".")[0] in FRAMEWORKS
                    and not module.startswith("transduce._console")):
                found.append(f"{os.path.relpath(path, PACKAGE)}:{line}: {target}")
    assert not found, found


def _marked(lines: list[str], start: int, end: int) -> bool:
    return any(line.strip().startswith(LONG_MARK) for line in lines[start:end])


def test_modules_and_functions_are_short_or_say_why():
    long = []
    for module, path in _modules():
        text = open(path, encoding="utf-8").read()
        lines = text.splitlines()
        tree = ast.parse(text, path)
        body_start = tree.body[1].lineno - 1 if len(tree.body) > 1 and ast.get_docstring(tree) else 0
        if len(lines) > MAX_MODULE_LINES and not _marked(lines, body_start, body_start + 8):
            long.append(f"{module}: {len(lines)} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                first = node.body[1] if ast.get_docstring(node) and len(node.body) > 1 else node.body[0]
                if n > MAX_FUNCTION_LINES and not _marked(lines, node.lineno, first.lineno + 1):
                    long.append(f"{module}.{node.name}: {n} lines")
    assert not long, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function, without a " \
                     f"'{LONG_MARK} reason' at its top:\n" + "\n".join(long)


def test_the_import_check_finds_an_upward_import_inside_a_function(tmp_path):
    """A runtime module importing the exporter, even inside a function, or through a relative import."""
    path = tmp_path / "api.py"
    path.write_text("import os\nfrom transduce.formats import contract\n\n\ndef f():\n"
                    "    from transduce.exporter.onnx_export import export_artifact\n    from ..verify import parity\n")
    wrong = _upward_imports([("transduce.runtime.api", str(path))])
    assert [w.split(": ", 1)[1] for w in wrong] == [
        "transduce.runtime.api (runtime) imports transduce.exporter.onnx_export.export_artifact "
        "(training, export, build)",
        "transduce.runtime.api (runtime) imports transduce.verify.parity (verification)"]
