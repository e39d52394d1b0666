"""Checks a frozen-dataclass config tree against its annotations, naming the offending key path.

Names of registered parts (estimators, losses, filters, ...) are plain ``str`` fields here; their
registries check them (``starpo_jax.config_checks.validate``), so a newly registered name is accepted.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


def _is_optional(annotation) -> bool:
    """Whether ``annotation`` is ``X | None``."""
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return is_union and type(None) in typing.get_args(annotation)


def check_value(value: Any, annotation, path: str) -> None:
    """Raises naming ``path`` unless ``value`` fits ``annotation`` (an int is accepted for a float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, annotation):
            raise TypeError(f"{path} must be a {annotation.__name__} section, got {value!r}")
        check_types(value, path + ".")
    elif _is_optional(annotation):
        if value is not None:
            check_value(value, next(a for a in args if a is not type(None)), path)
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in args:
            try:
                return check_value(value, option, path)
            except (TypeError, ValueError):
                continue
        raise TypeError(f"{path} must be {annotation}, got {value!r}")
    elif origin is Literal:
        if value not in args:
            raise ValueError(f"{path} must be one of {args}, got {value!r}")
    elif origin is tuple:
        if not isinstance(value, tuple):
            raise TypeError(f"{path} must be a tuple, got {value!r}")
        item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(value):
            raise ValueError(f"{path} must have {len(item_types)} entries, got {value!r}")
        for i, (item, item_type) in enumerate(zip(value, item_types)):
            check_value(item, item_type, f"{path}[{i}]")
    elif origin is Mapping:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} must be a mapping, got {value!r}")
        for key, item in value.items():
            check_value(key, args[0], f"{path} key {key!r}")
            check_value(item, args[1], f"{path}.{key}")
    elif not (type(value) is annotation or (annotation is float and type(value) is int)):
        raise TypeError(f"{path} must be {getattr(annotation, '__name__', annotation)}, got {value!r}")


def check_types(config, prefix: str = "") -> None:
    """Checks every field of the dataclass ``config`` (recursively), key paths starting with ``prefix``."""
    for name, annotation in typing.get_type_hints(type(config)).items():
        check_value(getattr(config, name), annotation, prefix + name)
