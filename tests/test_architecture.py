"""The shape of the code, enforced: short functions in veomni/distributed, no attributes planted on other objects,
no import of veomni.distributed from veomni.models (models are adapters; parallelism builds on them), and the
package layering README's "Building blocks" documents: a package imports only packages of lower layers, function-local
imports included, and no module imports itself back through others (no circle)."""

import ast
import pathlib
import re
from typing import Dict, Iterator, List, Sequence, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "veomni"
MAX_FUNCTION_LINES = 50


def _trees(folder: pathlib.Path):
    for path in sorted(folder.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: pathlib.Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_every_function_under_distributed_is_short():
    long = [
        f"{_where(path, node)} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _trees(PACKAGE / "distributed")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert not long, "functions of 50 lines or more:\n" + "\n".join(long)


def _planted(node: ast.AST) -> bool:
    """`x._veomni_y = ...`, `setattr(x, "_veomni_y", ...)` or `getattr(x, "_veomni_y", ...)`."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        return node.attr.startswith("_veomni_")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "getattr"):
        name = node.args[1] if len(node.args) > 1 else None
        return isinstance(name, ast.Constant) and str(name.value).startswith("_veomni_")
    return False


def _binds_a_forward(node: ast.AST) -> bool:
    """`x.forward = ...` or `setattr(x, "forward", ...)`."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        return node.attr == "forward"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        name = node.args[1] if len(node.args) > 1 else None
        return isinstance(name, ast.Constant) and name.value == "forward"
    return False


def test_instance_forwards_are_bound_only_through_compat():
    """A module's own forward is replaced nowhere but in veomni/compat (`bind_instance_method`, each use with its
    canary in tests/test_compat.py): models adapt through modules, wrappers and torch's hooks."""
    found = [
        _where(path, node)
        for path, tree in _trees(PACKAGE)
        if "compat" not in path.relative_to(PACKAGE).parts
        for node in ast.walk(tree)
        if _binds_a_forward(node)
    ]
    assert not found, "instance forward replaced outside veomni/compat:\n" + "\n".join(found)


def test_no_veomni_attributes_on_modules_or_tensors():
    found = [_where(path, node) for path, tree in _trees(PACKAGE) for node in ast.walk(tree) if _planted(node)]
    assert not found, "side channels through `_veomni_*` attributes:\n" + "\n".join(found)


def _imported_modules(path: pathlib.Path, tree: ast.AST):
    """Absolute names of every module `path` imports, function-local imports included."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield node, module
            for alias in node.names:  # `from .. import distributed`
                yield node, f"{module}.{alias.name}"


def test_models_never_import_distributed():
    found = [
        f"{_where(path, node)} imports {name}"
        for path, tree in _trees(PACKAGE / "models")
        for node, name in _imported_modules(path, tree)
        if name == "veomni.distributed" or name.startswith("veomni.distributed.")
    ]
    assert not found, "veomni.models -> veomni.distributed (a cycle with distributed -> models):\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------------- layering
# lowest first; a package may import the packages of lower layers only (a module its own package freely). Top-level
# modules (veomni/launch.py) count as packages of their own name. No allow-list: a new package must be placed here.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("utils",),
    ("compat", "arguments"),
    ("ops", "optim"),
    ("models",),
    ("distributed", "checkpoint"),
    ("data",),
    ("trainer",),
    ("plan", "launch", "chat"),
    ("verify",),  # python -m veomni.verify: runs the trainer and reads the planner
)


def _modules(root: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Dotted name -> file of every module under `root` (a `veomni` folder); packages by their __init__."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Iterator[Tuple[int, str]]:
    """(line, module) for every veomni module `name` imports, function-local imports included: `from . import x`
    means the submodule x; `from .a import f` the module a (and, through it, its package's __init__ when a is one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [module, *subs]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:  # `veomni.data.build_dataset` -> `veomni.data`
                parts.pop()
            if parts and ".".join(parts) != name:
                yield node.lineno, ".".join(parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(root: pathlib.Path, layers: Sequence[Sequence[str]] = LAYERS) -> List[str]:
    """Every import of a package from one not above it (same layer, or higher), and every unplaced package."""
    layer_of = {package: i for i, names in enumerate(layers) for package in names}
    modules = _modules(root)
    found = []
    for name, path in modules.items():
        mine = _package(name)
        if mine and mine not in layer_of:
            found.append(f"{path.relative_to(root.parent)}: package '{mine}' is in no layer of LAYERS")
            continue
        for line, target in _imports(name, path, modules):
            theirs = _package(target)
            if not mine or not theirs or theirs == mine or layer_of.get(theirs, -1) < layer_of[mine]:
                continue
            where = "its own layer" if layer_of.get(theirs) == layer_of[mine] else "a higher layer"
            found.append(f"{path.relative_to(root.parent)}:{line} ({mine}) imports {target} ({theirs}: {where})")
    return found


def import_circles(root: pathlib.Path) -> List[List[str]]:
    """Groups of modules that import each other, directly or through others (function-local imports included)."""
    modules = _modules(root)
    edges = {name: {t for _, t in _imports(name, path, modules)} for name, path in modules.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for name in modules:
        if name not in index:
            visit(name)
    return circles


def test_no_package_imports_one_above_or_beside_it():
    found = layering_violations(PACKAGE)
    assert not found, "imports against the layering (tests/test_architecture.py LAYERS):\n" + "\n".join(found)


def test_no_import_circle():
    circles = import_circles(PACKAGE)
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_layering_check_fails_on_an_upward_import_and_a_circle(tmp_path):
    """The two checks above on a small tree: a lower package importing a higher one (also function-locally), a
    package beside it, an unplaced package, and a circle, each found."""
    root = tmp_path / "veomni"
    files = {
        "__init__.py": "",
        "utils/__init__.py": "",
        "utils/a.py": "def f():\n    from ..trainer import loop\n",  # a function-local upward import
        "ops/__init__.py": "from . import b\n",
        "ops/b.py": "from ..optim import c\n",  # beside it
        "optim/__init__.py": "",
        "optim/c.py": "from ..utils import a\n",  # downward: fine
        "trainer/__init__.py": "",
        "trainer/loop.py": "from . import step\n",
        "trainer/step.py": "from .loop import x\n",  # a circle
        "extra/__init__.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    found = layering_violations(root, (("utils",), ("ops", "optim"), ("trainer",)))
    assert any("utils/a.py:2 (utils) imports veomni.trainer.loop (trainer: a higher layer)" in f for f in found), found
    assert any("ops/b.py:1 (ops) imports veomni.optim.c (optim: its own layer)" in f for f in found), found
    assert any("package 'extra' is in no layer" in f for f in found), found
    assert len(found) == 3, found
    assert import_circles(root) == [["veomni.trainer.loop", "veomni.trainer.step"]]


def test_readme_documents_the_layering():
    """README's "Building blocks" shows the same order as LAYERS."""
    readme = (PACKAGE.parent / "README.md").read_text()
    line = " -> ".join(", ".join(names) for names in LAYERS)
    assert re.search(re.escape(line), readme), f"README.md should show the layering: {line}"
