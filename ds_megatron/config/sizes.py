"""The named model shapes (``model.size``) of every family, each family's own (``model/<family>/__init__.py``
``SIZES``, each with its published learning rate), gathered from the registry.  Standard library only."""

from __future__ import annotations

from ds_megatron.model import FAMILIES
from ds_megatron.model.family import NamedShape

SHAPES: dict[str, NamedShape] = {name: s for f in FAMILIES.values() for name, s in f.sizes.items()}
# Peak learning rates of the named sizes that publish one, written into generated configs by the tuner.
LEARNING_RATES: dict[str, float] = {name: s.learning_rate for name, s in SHAPES.items() if s.learning_rate}


def named(name: str) -> NamedShape | None:
    """The named shape, or None."""
    return SHAPES.get(name)


def all_size_names() -> list[str]:
    return sorted(SHAPES)
