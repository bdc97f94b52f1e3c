"""The package's layering (README, "Layout"), enforced: a module imports only from layers below it (or its own
package), and the single-device model never touches torch.distributed or deepspeed."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ds_megatron"

# Higher number = higher layer.  Sub-levels order the L3 modules that build on each other.
LEVELS = {
    "config": 0,
    "fileio": 0.5,
    "topology": 1,
    "random": 1,
    "tensor_parallel": 2,
    "parallel": 2,
    "model": 2,
    "recompute": 2.5,
    "parallelize": 3,
    "optim": 3,
    "memory": 3,
    "flops": 3,
    "metrics": 3.2,
    "plot": 3,
    "data": 3,
    "pipeline": 3.5,
    "checkpoint": 3.7,
    "tune": 3.8,
    "preflight": 3.9,
    "engine": 4,
    "generate": 4,
    "stop": 4.2,
    "trainer": 4.5,
    "cli": 5,
}
STDLIB_ONLY = {"config", "fileio"}
NO_DISTRIBUTED = {"model"}


def _unit(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_module_has_a_level():
    units = {_unit(p) for p in PKG.rglob("*.py") if _unit(p) != "__init__"}
    assert units <= set(LEVELS), sorted(units - set(LEVELS))


def test_imports_point_down():
    bad = []
    for path in PKG.rglob("*.py"):
        unit = _unit(path)
        if unit == "__init__":
            continue
        for name in _imports(path):
            if name.startswith("ds_megatron."):
                target = name.split(".")[1]
                if target != unit and LEVELS[target] >= LEVELS[unit]:
                    bad.append(f"{path.relative_to(PKG)} imports {name} (level {LEVELS[target]} >= {LEVELS[unit]})")
            top = name.split(".")[0]
            if (
                unit in STDLIB_ONLY
                and top not in ("ds_megatron", "__future__")
                and top in ("torch", "deepspeed", "transformers", "numpy", "datasets", "wandb")
            ):
                bad.append(f"{path.relative_to(PKG)} (stdlib only) imports {name}")
            if unit in NO_DISTRIBUTED and (name.startswith("torch.distributed") or top == "deepspeed"):
                bad.append(f"{path.relative_to(PKG)} (single-device model) imports {name}")
    assert not bad, "\n".join(bad)


def test_recipes_are_not_imported_by_the_package():
    for path in PKG.rglob("*.py"):
        assert not any(n.startswith("recipes") for n in _imports(path)), path
