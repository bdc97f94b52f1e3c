"""What a worker process takes from the launcher that started it, before anything reads ``RANK`` or CUDA starts.

torch.distributed's ``env://`` rendezvous, DeepSpeed and the config check (the world size) read ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.  DeepSpeed's own per-node launcher and torchrun
set them; srun (``deepspeed --launcher slurm``, or ``srun python recipes/train_gpt.py``) and Open MPI's mpirun
(``--launcher openmpi``) set their own names instead.  :func:`adopt_launcher_env` fills in the torch names from
theirs, and only those not already set: a value the user or an outer launcher set wins.  With Open MPI and no
rendezvous address anywhere it leaves ``MASTER_ADDR`` unset, and ``deepspeed.init_distributed`` then finds it through
mpi4py (its ``mpi_discovery``, which sets the same rank, size and local rank); without mpi4py that is an error here.

:func:`order_cuda_connections` sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the process: the recipes export it, but
DeepSpeed's multi-node runners pass on only variables with a few prefixes (PYTHON*, UCX*, ...), so every node but the
first would lose it.  Standard library only: the CLI runs this before torch is imported.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
from collections.abc import MutableMapping

from ds_megatron.config import ConfigError

# torch.distributed's default rendezvous port, the one deepspeed.init_distributed's mpi_discovery uses too.
DEFAULT_MASTER_PORT = 29500
# Under Slurm without MASTER_PORT: a port per job (base + the job id's last four digits), so that two jobs sharing a
# node do not meet at one port.
SLURM_PORT_BASE = 20000
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# (torch name, Slurm name): what srun sets in every task of a step.  The step's task count, not SLURM_NTASKS: a batch
# script's shell also has SLURM_NTASKS (the job's), SLURM_PROCID and SLURM_LOCALID (0), and a single process started
# there must not wait for ranks that do not exist.
SLURM_NAMES = (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS"), ("LOCAL_RANK", "SLURM_LOCALID"))
OMPI_NAMES = (
    ("RANK", "OMPI_COMM_WORLD_RANK"),
    ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
    ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # the CPU thread share (engine.default_cpu_threads)
)
CUDA_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def adopt_launcher_env(env: MutableMapping[str, str] | None = None) -> str | None:
    """Fill in the torch.distributed variables from srun's or mpirun's; returns "slurm", "openmpi" or None (another
    launcher set them, or a single process).  Raises ConfigError when mpirun started the process and nothing says
    where rank 0 is."""
    env = os.environ if env is None else env
    if all(name in env for name in TORCH_NAMES):
        return None
    if all(theirs in env for _, theirs in SLURM_NAMES):
        _fill(env, SLURM_NAMES)
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodes:
            env.setdefault("MASTER_ADDR", expand_hostlist(nodes)[0])
        job = env.get("SLURM_JOB_ID", "")
        env.setdefault("MASTER_PORT", str(SLURM_PORT_BASE + int(job[-4:]) if job.isdigit() else DEFAULT_MASTER_PORT))
        return "slurm"
    if all(theirs in env for _, theirs in OMPI_NAMES[:3]):
        _fill(env, tuple((ours, theirs) for ours, theirs in OMPI_NAMES if theirs in env))
        if "MASTER_ADDR" not in env and env.get("SLURM_JOB_NODELIST"):  # mpirun inside a Slurm allocation
            env["MASTER_ADDR"] = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        if "MASTER_ADDR" in env:
            env.setdefault("MASTER_PORT", str(DEFAULT_MASTER_PORT))
        elif importlib.util.find_spec("mpi4py") is None:
            raise ConfigError(
                "MASTER_ADDR",
                "mpirun started this process but nothing names the host of rank 0",
                f"OMPI_COMM_WORLD_SIZE={env['OMPI_COMM_WORLD_SIZE']}, no MASTER_ADDR, mpi4py not installed",
                "pass it to every rank (deepspeed --launcher openmpi --launcher_args '-x MASTER_ADDR=<first host>', "
                "or mpirun -x MASTER_ADDR=<first host>), or pip install mpi4py",
            )
        return "openmpi"
    return None


def _fill(env: MutableMapping[str, str], names) -> None:
    for ours, theirs in names:
        env.setdefault(ours, env[theirs])


def expand_hostlist(text: str) -> list[str]:
    """The host names of a Slurm host list, in order: ``node[01-03,07],gpu-a[1-2]-ib`` -> node01, node02, node03,
    node07, gpu-a1-ib, gpu-a2-ib.  A range keeps its zero padding; several bracket groups in one name multiply."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text.strip()):
        pieces = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        choices = [[p] if i % 2 == 0 else _expand_ranges(p, text) for i, p in enumerate(pieces)]
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    if not hosts:
        raise ConfigError("SLURM_JOB_NODELIST", "no host in the node list", repr(text), "check the Slurm allocation")
    return hosts


def _expand_ranges(ranges: str, text: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError("SLURM_JOB_NODELIST", "not a Slurm host list", repr(text), "check the Slurm allocation")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def order_cuda_connections(tp: int, env: MutableMapping[str, str] | None = None) -> None:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless set, before CUDA starts (it is read when the CUDA context is
    created).  With one hardware queue per device, kernels start in the order they are issued: the asynchronous TP
    collectives of the linear layers' backward are then queued ahead of the GEMMs they overlap with, instead of
    behind them.  With tp > 1 another value is refused (the overlap would silently be lost)."""
    env = os.environ if env is None else env
    value = env.setdefault(CUDA_CONNECTIONS, "1")
    if tp > 1 and value != "1":
        raise ConfigError(
            CUDA_CONNECTIONS,
            "tensor parallelism overlaps its collectives with the GEMMs only when kernels start in issue order",
            f"{CUDA_CONNECTIONS}={value}, tp={tp}",
            f"unset it or set {CUDA_CONNECTIONS}=1",
        )
