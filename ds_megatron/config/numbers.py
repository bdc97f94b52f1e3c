"""Non-finite numbers refused wherever a number is read: the JSON config (DeepSpeed's keys and ours), ``--set``
values and float flags.  Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity`` as floats and ``float()``
parses "nan" and "inf"; a NaN then passes every range check written as a comparison (``lr <= 0`` is false) and
fails inside torch after the engine is built, an infinite memory size makes everything fit.  Standard library only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

from ds_megatron.config.errors import ConfigError

FINITE_FIX = "write a finite number (NaN and Infinity are not values a run can use)"


def non_finite(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(dotted path, value) of every NaN or infinite float in a JSON tree (lists as ``key[i]``)."""
    if isinstance(node, float) and not math.isfinite(node):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from non_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from non_finite(value, f"{path}[{i}]")


def check_finite(setting: str, value: Any) -> None:
    """Refuse a NaN or infinite number, naming ``setting``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(setting, "must be a finite number", f"got {value}", FINITE_FIX)


def check_finite_config(ds_config: dict) -> None:
    """Every number of a whole config (the file with its ``--set`` values and flags applied) is finite."""
    for path, value in non_finite(ds_config):
        check_finite(path, value)


def finite_float(text: str) -> float:
    """argparse ``type=`` for a float flag: what ``float()`` reads, without nan and inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None  # argparse's own wording
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value
