"""The versions of torch, deepspeed and transformers ds_megatron runs on, and the check ``import ds_megatron`` makes.

Standard library only, and the installed versions are read from the packages' metadata, never by importing them:
the analytic tuner (``ds_megatron.tune``) runs with neither torch nor deepspeed installed, and a package that is not
installed is not checked (its first import fails on its own).  pyproject.toml declares the same bounds
(tests/unit/test_versions.py holds the two together).

What sets each bound (read in the code and the packages' documentation, not run on the older releases):
- torch >= 2.8: ``recompute.discard_output`` chains saved-tensor hooks through
  ``torch._C._autograd._top_saved_tensors_default_hooks``, which torch 2.8 added (older releases have no way to read
  the hook stack, as compatibility layers of other projects record); ``F.scaled_dot_product_attention(enable_gqa=)``
  and ``torch.serialization.safe_globals`` (the weights-only checkpoint reader) need 2.5.  The flash kernels that
  ``parallel.cp_kernels`` calls (``aten._scaled_dot_product_flash_attention[_for_cpu][_backward]``) and the
  collectives used (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``get_global_rank``,
  ``batch_isend_irecv``) are older than 2.5; nothing uses ``torch._grouped_mm`` or ``torch.nn.attention``.
- deepspeed 0.19.x (>= 0.19.3): the pipeline engine is driven through about 70 private names (``_INSTRUCTION_MAP``,
  ``_exec_*`` methods, ``_hp_grad``, ``DualPipeVEngine``), checked on 0.19.8 only; older 0.19 releases mis-scale
  pipeline gradients under gradient accumulation.  0.20 and later are refused until tested.
- transformers >= 4.56: ``from_pretrained(dtype=)`` (the inference measurement) replaced ``torch_dtype`` there;
  export and import use ``AutoConfig``, ``GPT2Config``, ``LlamaConfig`` and ``GenerationConfig`` only.  Not checked
  at import: it is imported lazily by the commands that need it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from importlib import metadata

TORCH_MIN = (2, 8)
DEEPSPEED_MIN = (0, 19, 3)
DEEPSPEED_BELOW = (0, 20)  # the first untested release series
TRANSFORMERS_MIN = (4, 56)
# Set to 1 to run on versions outside these bounds anyway (a warning instead of the error).
SKIP_ENV = "DS_MEGATRON_SKIP_VERSION_CHECK"


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# The requirement strings of pyproject.toml's dependencies, written from the bounds above.
REQUIREMENTS = {
    "torch": f"torch>={_dotted(TORCH_MIN)}",
    "deepspeed": f"deepspeed>={_dotted(DEEPSPEED_MIN)},<{_dotted(DEEPSPEED_BELOW)}",
    "transformers": f"transformers>={_dotted(TRANSFORMERS_MIN)}",
}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0), "2.8.0a0+git1234" -> (2, 8, 0)."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def problems(version_of: Callable[[str], str] = metadata.version) -> list[str]:
    """One line per installed package whose version is outside its bounds (empty when all are fine)."""
    found = []
    for name, low, below in (("torch", TORCH_MIN, None), ("deepspeed", DEEPSPEED_MIN, DEEPSPEED_BELOW)):
        try:
            installed = version_of(name)
        except metadata.PackageNotFoundError:
            continue
        if release(installed) < low or (below is not None and release(installed) >= below):
            found.append(f"{name} {installed} is installed, ds_megatron needs {REQUIREMENTS[name]}")
    return found


def check_installed(version_of: Callable[[str], str] = metadata.version) -> None:
    """Raise ImportError (one line naming the versions and the fix) when torch or deepspeed is out of bounds."""
    found = problems(version_of)
    if not found:
        return
    fix = " ".join(f"'{REQUIREMENTS[line.split()[0]]}'" for line in found)
    message = f"{'; '.join(found)}: run pip install {fix} (or set {SKIP_ENV}=1 to try anyway)"
    if os.environ.get(SKIP_ENV) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise ImportError(message)
