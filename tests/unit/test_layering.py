"""The package's layering (README, "Layout"), enforced: a module imports only from layers below it (or its own
package), and the single-device model never touches torch.distributed or deepspeed."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path, PurePosixPath

PKG = Path(__file__).resolve().parents[2] / "ds_megatron"

# Higher number = higher layer.  Sub-levels order the modules of one layer that build on each other.  "families" is
# the model package's standard-library part (FAMILY_RECORD_FILES), below the config that reads its names and rules;
# "model" is the rest of the package (the torch side).
LEVELS = {
    "versions": 0,  # the supported versions, checked by the package's __init__ (standard library only)
    "families": 0,
    "schedules": 0.1,  # the pipeline schedules' pure parts (SCHEDULE_RECORD_FILES), read by the config and the tuner
    "config": 0.2,
    "fileio": 0.5,
    "gpus": 0.5,
    "launch_env": 0.5,
    "topology": 1,
    "random": 1,
    "model": 1.5,
    "tensor_parallel": 2,
    "context_parallel": 2,
    "expert_parallel": 2.1,  # expert TP enters and leaves the TP group through tensor_parallel's collectives
    "recompute": 2.5,
    "parallelize": 3,
    "optim": 3,
    "memory": 3,
    "flops": 3,
    "metrics": 3.2,
    "plot": 3,
    "data": 3,
    "pipeline_parallel": 3.5,
    "checkpoint": 3.7,
    "tune": 3.8,
    "preflight": 3.9,
    "engine": 4,
    "generate": 4,
    "stop": 4.2,
    "trainer": 4.5,
    "cli": 5,
}
# the family records (test_the_family_registry_and_records_import_no_torch), the GPU peaks, the version check, and
# launch_env, which runs before torch is imported
STDLIB_ONLY = {"config", "fileio", "gpus", "launch_env", "schedules", "versions"}
NO_DISTRIBUTED = {"model"}
# The model package's files that the config, the tuner and the analytic formulas import without torch: the registry,
# the family record type, and each family's record (its config, sizes, plan, layout and terms).
FAMILY_RECORD_FILES = ("model/__init__.py", "model/family.py", "model/*/__init__.py")
# The pipeline package's files that import no torch: the schedules' records, orders and timing model, and the NCCL
# rendezvous model.
SCHEDULE_RECORD_FILES = ("pipeline_parallel/schedules/*.py", "pipeline_parallel/rendezvous.py")


def _unit(path: Path) -> str:
    if any(path.match(str(PKG / pattern)) for pattern in FAMILY_RECORD_FILES):
        return "families"
    if any(path.match(str(PKG / pattern)) for pattern in SCHEDULE_RECORD_FILES):
        return "schedules"
    rel = path.relative_to(PKG).parts
    return rel[0].removesuffix(".py")


def _target(name: str) -> str:
    """The unit an import ``ds_megatron.<...>`` reaches: the registry, the record type and a family's record are
    "families"; ``model.layers``, ``model.kernels`` and a family's ``model`` module the torch side, "model"."""
    parts = name.split(".")[1:]
    files = (PurePosixPath("/".join(parts) + ".py"), PurePosixPath("/".join(parts), "__init__.py"))
    if parts[0] == "pipeline_parallel" and any(f.match(p) for f in files for p in SCHEDULE_RECORD_FILES):
        return "schedules"
    if parts[0] != "model":
        return parts[0]
    return "model" if parts[1:2] in (["layers"], ["kernels"]) or parts[2:] == ["model"] else "families"


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for every test of this module (the trees are only read)."""
    return ast.parse(path.read_text())


@functools.cache
def _imports(path: Path) -> tuple[str, ...]:
    """The absolute imports of a file, read once for every test of this module."""
    tree = _tree(path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return tuple(names)


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
                target = _target(name)
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


def _module_level_imports(path: Path) -> list[str]:
    """What importing the module imports (a function's own imports, e.g. transformers in ``to_hf``, run later)."""
    names = []
    for node in _tree(path).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return tuple(names)


def test_the_family_registry_and_records_import_no_torch():
    bad = []
    paths = [path for pattern in FAMILY_RECORD_FILES for path in PKG.glob(pattern)]
    assert len(paths) >= 4, paths  # the registry, the record type and at least two family records
    for path in paths:
        for name in _module_level_imports(path):
            top = name.split(".")[0]
            if top in ("torch", "deepspeed", "transformers", "numpy"):
                bad.append(f"{path.relative_to(PKG)} imports {name}")
            if name.startswith("ds_megatron.") and not name.startswith(("ds_megatron.model", "ds_megatron.config")):
                bad.append(f"{path.relative_to(PKG)} imports {name}")
            if name == "ds_megatron.model.layers" or (
                name.startswith("ds_megatron.model.") and name.endswith(".model")
            ):
                bad.append(f"{path.relative_to(PKG)} imports {name} (a family's torch side)")
    assert not bad, "\n".join(bad)


def _family_names() -> set[str]:
    """The registered families' names, read off each family folder's record (``NAME = "..."``) without importing."""
    names = set()
    for config in PKG.glob("model/*/__init__.py"):
        for node in ast.walk(_tree(config)):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAME" for t in node.targets):
                names.add(node.value.value)
    return names


def test_the_config_names_the_registered_families():
    from ds_megatron.config.schema import MODEL_FAMILIES
    from ds_megatron.model import FAMILIES

    assert MODEL_FAMILIES == tuple(FAMILIES)


def test_no_family_is_named_outside_its_folder_and_the_registry():
    """Outside the family folders and the registry no string is a family's name (so no branch compares with one)
    and no module imports one family's record (a third family adds a folder and a registry line, nothing else)."""
    names = _family_names()
    assert names == {"gpt2", "llama", "qwen3_moe", "mixtral", "qwen2_moe"}, names
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel == "model/__init__.py" or (rel.startswith("model/") and rel.count("/") == 2):
            continue  # the registry and the family folders
        tree = _tree(path)
        found += [
            f"{rel}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names
        ]
        found += [f"{rel} imports {n}" for n in _imports(path) if n.split(".")[1:3] in [["model", f] for f in names]]
    assert not found, found


def test_the_partition_default_names_the_pipelines_block_class():
    """The config (standard library only) names the pipeline's block layer class so that a ``type:`` partition
    pattern matching no block is refused before launch; the name must be the class's."""
    from ds_megatron.config.schema import BLOCK_LAYER_CLASS, ParallelSection
    from ds_megatron.pipeline_parallel.module import BlockPipe

    assert BlockPipe.__name__ == BLOCK_LAYER_CLASS
    assert ParallelSection().partition_method == f"type:{BlockPipe.__name__}"


def test_docstring_levels_are_the_tables():
    """A module docstring that opens with its level (``L3.5: ...``) states the level of LEVELS above."""
    bad = []
    for path in PKG.rglob("*.py"):
        doc = ast.get_docstring(_tree(path)) or ""
        match = re.match(r"L(\d+(?:\.\d+)?):", doc)
        if match and _unit(path) != "__init__" and float(match.group(1)) != LEVELS[_unit(path)]:
            bad.append(f"{path.relative_to(PKG)}: L{match.group(1)}, the table says {LEVELS[_unit(path)]}")
    assert not bad, "\n".join(bad)


# The family record's transformers names (model/family.py, model/<family>/__init__.py) and the one module that turns
# tensors with them: the state-dict adapter.  Every checkpoint path (export, import, --init-from-hf, resharding) goes
# through the adapter, so no other file reads the names or cuts a parameter into TP shards itself.
ADAPTER = "checkpoint/adapter.py"
HF_NAME_READERS = ("is_hf_transposed", "hf_transposed", "hf_base_prefix", "hf_ignored", "hf_experts", "our_hf_name")
HF_NAME_READERS += ("hf_canonical", "hf_name", "CONV1D_SUFFIXES", "HFExperts", "STACKED_EXPERTS", "EXPERT_PARTS")
TP_CUTS = ("shard_rule", "shard", "unshard")


def test_only_the_state_dict_adapter_reads_the_hf_names_and_cuts_checkpoints():
    root = PKG.parent
    found = []
    for path in [*PKG.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]:
        rel = path.relative_to(PKG).as_posix() if path.is_relative_to(PKG) else path.relative_to(root).as_posix()
        if rel in (ADAPTER, "model/family.py") or (rel.startswith("model/") and rel.endswith("/__init__.py")):
            continue
        text = path.read_text()
        if not any(name in text for name in (*HF_NAME_READERS, *TP_CUTS)):
            continue  # every finding below names one of them in the source: nothing to parse
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr in HF_NAME_READERS:
                found.append(f"{rel}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ds_megatron"):
                names = {a.name for a in node.names}
                found += [f"{rel} imports {n}" for n in names & set(HF_NAME_READERS)]
                if rel.startswith("checkpoint/"):  # the package's checkpoint paths shard through the adapter
                    found += [f"{rel} imports {n}" for n in names & set(TP_CUTS)]
    assert not found, found


def _schedule_names() -> dict[str, str]:
    """The registered schedules' names, read off each record module (``NAME = "..."``) without importing: name ->
    the record's module."""
    names = {}
    for record in PKG.glob("pipeline_parallel/schedules/*.py"):
        for node in ast.walk(_tree(record)):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAME" for t in node.targets):
                names[node.value.value] = record.stem
    return names


def test_no_schedule_is_named_outside_its_record():
    """Outside the schedules' folder no string is a schedule's name (so no branch compares with one; an f-string's
    literal parts that quote one count too) and no module imports one schedule's record: a new schedule adds its
    record and a registry line there, its engine, and a test."""
    names = _schedule_names()
    assert set(names) == {
        "1f1b",
        "dualpipev",
        "zb-h1",
        "zb-h2",
        "dualpipev-zb",
        "interleaved-1f1b",
        "interleaved-zb",
    }, names
    quoted = re.compile("|".join(rf"(?<![\w-]){re.escape(n)}(?![\w-])" for n in sorted(names, key=len, reverse=True)))
    found = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("pipeline_parallel/schedules/"):
            continue
        tree = _tree(path)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            f"{rel}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and (node.value in names or re.search(rf"[\"']({quoted.pattern})[\"']", node.value))
        ]
        modules = {f"ds_megatron.pipeline_parallel.schedules.{m}" for m in names.values()}
        found += [f"{rel} imports {n}" for n in _imports(path) if n in modules]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ds_megatron.pipeline_parallel.schedules":
                found += [f"{rel} imports {a.name}" for a in node.names if a.name in names.values()]
    assert not found, "\n".join(found)


def test_tune_halves_import_only_the_core():
    """The tool's training and inference halves meet in ``tune/core`` only: neither imports the other, and the core
    imports neither (nor the package root, which re-exports the training half's API)."""
    tune = PKG / "tune"
    forbidden = {"core": ("training", "inference"), "training": ("inference",), "inference": ("training",)}
    bad = []
    for half, others in forbidden.items():
        for path in (tune / half).rglob("*.py"):
            for name in _imports(path):
                reaches = (
                    name.removeprefix("ds_megatron.tune.").split(".")[0]
                    if name.startswith("ds_megatron.tune.")
                    else None
                )
                if reaches in others or name == "ds_megatron.tune":
                    bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)
