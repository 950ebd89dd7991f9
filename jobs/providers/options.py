"""A provider's options objects (dataclasses), built from the values named as their fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["by_name"]

D = TypeVar("D", bound="DataclassInstance")


def by_name(cls: type[D], values: Mapping[str, Any]) -> D:
    """A ``cls`` of the ``values`` named as its fields (the others are left out): a
    provider's launch options from its attributes (``vars(self)``), or from the arguments
    of its constructor (``locals()``)."""
    return cls(**{f.name: values[f.name] for f in fields(cls)})
