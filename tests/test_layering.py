"""Imports run one way: experiments → serving → decode loops → model → caches → ops, config at the bottom;
and no class or function in ``mtp/`` grows past what a reader takes in at once.

Every module of ``mtp/`` belongs to one layer of `LAYERS` and may import only its own layer and
those below it; imports inside functions count, since a deferred import is how a cycle hides. The
experiments and configs sit on top, and nothing in ``mtp/`` imports them. A module that no layer
names fails the test: placing it is a design decision, made here.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top. A layer's modules are named by package prefix (``mtp.ops`` covers ``mtp.ops.fp8.api``).
LAYERS = (
    ("config", ("mtp", "mtp.execution", "mtp.config", "mtp.runtime", "mtp.metrics", "mtp.carry", "mtp.data")),
    ("ops", ("mtp.ops",)),
    ("caches", ("mtp.cache",)),
    ("model", ("mtp.model",)),
    ("head and weight formats", ("mtp.mtp_head", "mtp.quant", "mtp.hf_layout")),
    ("checkpoint I/O and analysis", ("mtp.checkpoint", "mtp.analysis")),
    ("sharding", ("mtp.sharding",)),
    ("decode loops", ("mtp.speculative", "mtp.turn_start", "mtp.generation", "mtp.train")),
    ("serving", ("mtp.serving",)),
    ("experiments", ("experiments", "configs")),
)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    files = [*(ROOT / "mtp").rglob("*.py"), *(ROOT / "experiments").rglob("*.py"), *(ROOT / "configs").rglob("*.py")]
    return {_module_name(p): p for p in files}


def _layer(module: str) -> int:
    """The index in `LAYERS` of the longest prefix naming ``module``; -1 for none."""
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body, each as the module that defines the name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from mtp.ops import fp8`` imports the module ``mtp.ops.fp8``; ``from mtp.ops.fp8 import
            # dequantize`` the package that defines the name.
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                out.add(name)
    return out


def test_every_module_has_a_layer():
    assert not sorted(m for m in _modules() if _layer(m) < 0)


def test_imports_run_down_the_layers():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        for dep in _imports(path, modules):
            if dep == "mtp":  # the package itself, for ``from mtp import x``: x is counted on its own
                continue
            if _layer(dep) > _layer(module):
                upward.append(f"{module} ({LAYERS[_layer(module)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m, "mtp"} for m, p in modules.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 250, 100


def test_no_class_over_250_lines_and_no_function_over_100():
    long = []
    for path in sorted((ROOT / "mtp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
