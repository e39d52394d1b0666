"""Presets of both products: typed, composable edits of a config value, then the user's ``key=value`` overrides.

A ``Preset`` maps dotted key paths to typed values, ``Preset({"algorithm.adv_estimator": "grpo"})``;
``a + b`` applies ``a`` then ``b`` (``b`` wins on a shared key). ``apply`` edits a frozen dataclass
tree (and mappings inside it, such as StarPO's ``custom_envs``) with ``dataclasses.replace``, so a
preset is a value of the config's own type once applied. A named preset may also be a config value
itself (TDD's ``DISTIL_PRESETS``). ``build_config`` resolves either, then parses the command line's
RAGEN-style overrides on top (``runtime.config.parse_config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Sequence, TypeVar

from runtime.config import parse_config

C = TypeVar("C")


class Preset:
    """Typed edits of a config tree by dotted key path, applied in insertion order."""

    def __init__(self, edits: Mapping[str, Any] | None = None, /, **top_level: Any):
        self.edits: dict[str, Any] = {**(edits or {}), **top_level}

    def __add__(self, other: Preset) -> Preset:
        return Preset({**self.edits, **other.edits})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Preset) and self.edits == other.edits

    def __repr__(self) -> str:
        return f"Preset({self.edits!r})"

    def apply(self, config: C) -> C:
        """``config`` with every edit made; raises a KeyError naming a path the config does not have."""
        for path, value in self.edits.items():
            config = _replace(config, path.split("."), value, path)
        return config


def _replace(node: Any, keys: list[str], value: Any, path: str) -> Any:
    """``node`` with the entry at ``keys`` set to ``value`` (dataclass fields and mapping keys)."""
    if not keys:
        return value
    key, rest = keys[0], keys[1:]
    if isinstance(node, Mapping):
        if rest and key not in node:
            raise KeyError(f"preset key {path}: no entry {key!r} (it has {sorted(node)})")
        return {**node, key: _replace(node.get(key), rest, value, path)}
    if not dataclasses.is_dataclass(node) or key not in {f.name for f in dataclasses.fields(node)}:
        raise KeyError(f"preset key {path}: {type(node).__name__} has no field {key!r}")
    return dataclasses.replace(node, **{key: _replace(getattr(node, key), rest, value, path)})


def build_config(config_type: type[C], preset: Preset | C, argv: Sequence[str] = (), *,
                 description: str | None = None) -> C:
    """The preset (edits of ``config_type()``, or a config value) with ``argv``'s overrides parsed on top."""
    base = preset.apply(config_type()) if isinstance(preset, Preset) else preset
    return parse_config(config_type, base, argv, description=description)
