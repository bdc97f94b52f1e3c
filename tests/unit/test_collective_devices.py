"""Every tensor the package hands to a collective lives on the engine's device.

NCCL reduces, gathers and sends CUDA tensors only: a CPU tensor fails with "No backend type associated with device
type cpu", on GPUs alone, since gloo on CPU accepts it.  A runtime check in the in-process tier cannot tell the two
apart: every tensor of a CPU run is on the CPU, as the engine's device is (the meta device is no stand-in either:
a collective cannot run on it).  So the contract is checked on the source, the way the bug arises: a tensor built
by a factory that takes a device (``torch.tensor``, ``torch.zeros``, ``torch.empty``...) without ``device=`` is
born on the CPU, and handed as it is to a collective it crashes NCCL.

The lint reads every module of the package and the recipes and, for each call of a tensor collective of
``torch.distributed`` or ``deepspeed.comm`` (under any alias, or imported by name), follows each tensor argument
back to the last assignment of its name before the call in the same function.  It flags the argument when that
expression is such a factory call without ``device=`` (or ``torch.from_numpy``, always CPU), a method called on one
other than ``.to``/``.cuda`` (``torch.zeros(2).float()`` stays on the CPU), or a list holding one (``all_gather``'s
output list).  ``x.to(device)``, ``torch.zeros(..., device=d)``, ``*_like`` factories and tensors received from
elsewhere pass.  A collective on a group created with ``new_group(..., backend="gloo")`` (a CPU-only group, e.g.
for object exchange) is exempt.  Object collectives (``all_gather_object``, ``broadcast_object_list``) take Python
objects and are not checked: NCCL serialises them onto ``torch.cuda.current_device()``, which is right once
``torch.cuda.set_device(LOCAL_RANK)`` has run (DeepSpeed's launcher path and ``measure_inference`` set it).

What it cannot see: a CPU tensor built in another function and passed in, or one built by a factory this list
does not name; those need a reader's eye, as before.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("ds_megatron", "recipes")
COMM_MODULES = {"torch.distributed", "deepspeed.comm"}
# Collectives whose arguments are tensors (P2POp's tensor is its second argument; the rest are checked alike).
TENSOR_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "inference_all_reduce",
}
TENSOR_KEYWORDS = {"tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor", "output_tensor_list"}
# torch functions that make a new tensor on the default device (the CPU) unless given ``device=``.
DEVICE_FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
}
MOVES = {"to", "cuda"}  # methods that put a tensor on a device


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _comm_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(aliases of the communication modules, collective functions imported by name) in one module."""
    modules, functions = set(COMM_MODULES), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in COMM_MODULES:
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in COMM_MODULES:
                    modules.add(a.asname or a.name)
                elif node.module in COMM_MODULES and a.name in TENSOR_COLLECTIVES:
                    functions.add(a.asname or a.name)
    return modules, functions


def _collective(call: ast.Call, modules: set[str], functions: set[str]) -> str | None:
    name = _dotted(call.func)
    if name is None:
        return None
    if name in functions:
        return name
    base, _, leaf = name.rpartition(".")
    return leaf if base in modules and leaf in TENSOR_COLLECTIVES else None


def _cpu_factory(expr: ast.AST) -> str | None:
    """Why ``expr`` makes a CPU tensor (the factory's source), or None."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        return next((why for e in expr.elts if (why := _cpu_factory(e))), None)
    if isinstance(expr, ast.ListComp):
        return _cpu_factory(expr.elt)
    if not isinstance(expr, ast.Call):
        return None
    name = _dotted(expr.func) or ""
    if isinstance(expr.func, ast.Attribute) and not name.startswith("torch."):
        # a method: .to/.cuda move the tensor; any other keeps the receiver's device
        return None if expr.func.attr in MOVES else _cpu_factory(expr.func.value)
    leaf = name.removeprefix("torch.")
    if leaf == "from_numpy" or (leaf in DEVICE_FACTORIES and not any(k.arg == "device" for k in expr.keywords)):
        return ast.unparse(expr)
    return None


def _gloo_groups(tree: ast.Module) -> set[str]:
    """Names (variables or attributes) bound to a ``new_group(..., backend="gloo")``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = _dotted(node.value.func) or ""
            gloo = any(
                k.arg == "backend" and isinstance(k.value, ast.Constant) and k.value.value == "gloo"
                for k in node.value.keywords
            )
            if func.endswith("new_group") and gloo:
                names.update(t.attr if isinstance(t, ast.Attribute) else _dotted(t) for t in node.targets)
    return names


def _last_assignment(scope: ast.AST, name: str, before: int) -> ast.AST | None:
    """The value last bound to ``name`` in ``scope`` on a line before ``before``."""
    found, line = None, -1
    for node in ast.walk(scope):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and line < node.lineno < before and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found, line = node.value, node.lineno
    return found


def cpu_tensors_in_collectives(source: str, filename: str = "<source>") -> list[str]:
    """One line per tensor argument of a collective in ``source`` that is built on the CPU (module docstring)."""
    tree = ast.parse(source)
    modules, functions = _comm_names(tree)
    calls = [(n, op) for n in ast.walk(tree) if isinstance(n, ast.Call) and (op := _collective(n, modules, functions))]
    if not calls:  # most modules call no collective: their groups and scopes need no walk
        return []
    gloo = _gloo_groups(tree)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found = []
    for node, op in calls:
        group = next((k.value for k in node.keywords if k.arg == "group"), None)
        if group is not None and (group.attr if isinstance(group, ast.Attribute) else _dotted(group)) in gloo:
            continue
        # innermost function around the call: the one whose body spans its line, latest start
        around = [s for s in scopes if s.lineno <= node.lineno <= s.end_lineno]
        scope = max(around, key=lambda s: s.lineno) if around else tree
        args = node.args[1:2] if op == "P2POp" else node.args
        args = [*args, *(k.value for k in node.keywords if k.arg in TENSOR_KEYWORDS)]
        for arg in args:
            value = _last_assignment(scope, arg.id, node.lineno) if isinstance(arg, ast.Name) else arg
            why = _cpu_factory(value) if value is not None else None
            if why:
                found.append(f"{filename}:{node.lineno}: {op}({ast.unparse(arg)}) gets a CPU tensor: {why}")
    return found


def package_findings() -> list[str]:
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += cpu_tensors_in_collectives(path.read_text(), str(path.relative_to(ROOT)))
    return found


def test_no_cpu_tensor_reaches_a_collective():
    """Every collective of the package and the recipes gets tensors on the engine's device (NCCL's contract)."""
    found = package_findings()
    assert not found, "tensors built on the CPU reach a collective (pass device=):\n" + "\n".join(found)


# The two shapes the contract was missed in: a per-stage table reduced over every rank (pipeline zero-bubble costs)
# and a per-forward time reduced over the TP ranks (the inference tuner's timing).
TABLE_REDUCED = """
import statistics
import torch

def agreed_costs(timing, stage, num_stages):
    table = torch.zeros(num_stages, 6, dtype=torch.float64)
    table[stage, 0] = statistics.median(timing["F"])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(table)
    return table
"""
TIME_REDUCED = """
def one_request(model, collective, torch, dist):
    import torch.distributed as dist
    def timed(**inputs):
        result = model(**inputs)
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if collective:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return result, float(seconds)
"""


def test_the_lint_flags_cpu_tensors_handed_to_collectives():
    assert len(cpu_tensors_in_collectives(TABLE_REDUCED)) == 1
    assert "all_reduce(seconds)" in cpu_tensors_in_collectives(TIME_REDUCED)[0]
    others = """
from deepspeed import comm as ds_comm
from torch.distributed import broadcast
import torch.distributed as dist

def f(x, group, peer):
    parts = [torch.empty(4) for _ in range(2)]
    dist.all_gather(parts, x, group=group)
    broadcast(torch.arange(3), src=0)
    ds_comm.all_reduce(torch.ones(2).float())
    dist.P2POp(dist.isend, torch.from_numpy(x), peer)
"""
    assert [line.split(": ")[1] for line in cpu_tensors_in_collectives(others)] == [
        "all_gather(parts) gets a CPU tensor",
        "broadcast(torch.arange(3)) gets a CPU tensor",
        "all_reduce(torch.ones(2).float()) gets a CPU tensor",
        "P2POp(torch.from_numpy(x)) gets a CPU tensor",
    ]


def test_the_lint_passes_device_tensors_and_gloo_groups():
    fine = """
import torch
import torch.distributed as dist

class Exchange:
    def __init__(self):
        self.cpu_group = dist.new_group(backend="gloo")

    def costs(self, device, x):
        flag = torch.tensor([1.0], device=device)
        dist.all_reduce(flag)
        message = torch.zeros(2, dtype=torch.long)
        message = message.to(device)
        dist.broadcast(message, src=0)
        dist.all_reduce(torch.zeros_like(x))
        dist.all_reduce(torch.zeros(3), group=self.cpu_group)
        gathered = [None] * 2
        dist.all_gather_object(gathered, {"a": 1})
"""
    assert cpu_tensors_in_collectives(fine) == []
