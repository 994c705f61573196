"""The package is laid out by layer and imports point down only:
io <- model <- search <- studies <- cli (and the package's own __init__ on top)."""
from __future__ import annotations

import ast
from pathlib import Path

import autopar

PKG = Path(autopar.__file__).resolve().parent
LAYERS = ("io", "model", "search", "studies", "cli")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "autopar":
        return None
    if len(parts) == 1:
        return len(LAYERS)                  # the package's public API: on top
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def _imports(path: Path, module: str):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level] if path.name != "__init__.py" \
                    else module.split(".")[: len(module.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "autopar":
                for a in node.names:
                    yield f"autopar.{a.name}" if a.name in LAYERS else "autopar"
            else:
                yield target


def test_every_module_sits_in_a_layer():
    loose = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert loose == [], f"modules outside the layers: {loose}"
    assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} \
        == set(LAYERS)


def test_imports_point_down_only():
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        own = _layer(module)
        for target in _imports(path, module):
            layer = _layer(target)
            if own is not None and layer is not None and layer > own:
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_model_functions_take_no_keyword_catch_alls():
    """The model's stages pass their inputs explicitly (issue #26): no call
    spreads ``**locals()``, and a ``**name`` parameter is only forwarded
    whole to a call (a layer constructor's options to ``layer``, which
    names every keyword it takes), never swallowed as ``**_``."""
    found = []
    for path in sorted((PKG / "model").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg is None and isinstance(kw.value, ast.Call) \
                            and getattr(kw.value.func, "id", "") in ("locals", "vars"):
                        found.append(f"{path.name}:{node.lineno} spreads **{kw.value.func.id}()")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.kwarg:
                name = node.args.kwarg.arg
                forwarded = any(isinstance(c, ast.Call) and any(
                    k.arg is None and isinstance(k.value, ast.Name) and k.value.id == name
                    for k in c.keywords) for c in ast.walk(node))
                if not forwarded:
                    found.append(f"{path.name}:{node.lineno} {node.name} drops **{name}")
    assert found == []
