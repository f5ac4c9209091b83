"""The shape of the code, enforced: short functions in veomni/distributed, no attributes planted on other objects,
no import of veomni.distributed from veomni.models (models are adapters; parallelism builds on them)."""

import ast
import pathlib

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
