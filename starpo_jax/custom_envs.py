"""RAGEN's ``custom_envs.<Tag>.<key>=value`` overrides of the environment registry (``config/envs.yaml``).

``custom_envs.SimpleSokoban.max_actions_per_traj=15`` sets a tag-level key,
``custom_envs.Bandit.env_config.lo_arm_name=Engineer`` a constructor keyword of the tag's type, and
``custom_envs.BanditRev.env_type=bandit`` defines a new tag, which starts from the type's own budget,
instruction and ``max_tokens`` and which ``es_manager.*.env_configs.tags`` may then name. Types are
RAGEN's names (``bandit``, ``sokoban``, ``frozen_lake``, ``countdown``); class names such as
``FrozenLake`` are read as the same type.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Mapping, Sequence

import envs
from envs.registry import ENV_TYPES, EnvEntry, env_config_types
from runtime.config import value_from_text
from starpo_jax.config_types import check_value

SECTION = "custom_envs"
TAG_KEYS = ("max_actions_per_traj", "env_instruction", "max_tokens")


def env_type_name(text: str, key: str) -> str:
    """RAGEN's ``env_type`` name that ``text`` spells (``FrozenLake`` or ``frozen_lake``: ``frozen_lake``)."""
    name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", text.strip()).lower()
    if name not in ENV_TYPES:
        raise ValueError(f"{key} must be one of {tuple(ENV_TYPES)}, got {text!r}")
    return name


def apply_overrides(custom_envs: Mapping[str, EnvEntry], overrides: Sequence[tuple[str, str]]) -> dict[str, EnvEntry]:
    """``custom_envs`` with ``(key, text)`` overrides applied (``runtime.config.split_section`` pairs).

    ``env_type`` keys are applied first, so a new tag's other keys may come before its type; a
    type other than the tag's current one restarts the entry from that type's defaults.

    Raises:
      ValueError: naming the key for an unknown key, tag, type or ``env_config`` keyword, or a
        value that is not of the key's type.
    """
    entries = dict(custom_envs)
    hints = typing.get_type_hints(EnvEntry)
    for key, text in sorted(overrides, key=lambda pair: not pair[0].endswith(".env_type")):
        _, tag, *field = key.split(".")
        if field == ["env_type"]:
            env_type = env_type_name(text, key)
            if tag not in entries or entries[tag].env_type != env_type:
                entries[tag] = EnvEntry.of_type(env_type)
            continue
        if tag not in entries:
            raise ValueError(f"{key}: custom_envs has no tag {tag!r} (it has {sorted(entries)}); define it with "
                             f"{SECTION}.{tag}.env_type=<one of {', '.join(ENV_TYPES)}>")
        entry = entries[tag]
        if len(field) == 1 and field[0] in TAG_KEYS:
            entries[tag] = dataclasses.replace(entry, **{field[0]: value_from_text(text, hints[field[0]], key)})
        elif len(field) == 2 and field[0] == "env_config":
            keywords = env_config_types(entry.env_type)
            if field[1] not in keywords:
                raise ValueError(f"unknown key {key}: {entry.env_type} environments take env_config keys "
                                 f"{sorted(keywords)}")
            value = value_from_text(text, keywords[field[1]], key)
            entries[tag] = dataclasses.replace(entry, env_config={**entry.env_config, field[1]: value})
        else:
            raise ValueError(f"unknown key {key}: an entry has env_type, {', '.join(TAG_KEYS)} and "
                             f"env_config.<keyword>")
    return entries


def validate_custom_envs(custom_envs: Mapping[str, EnvEntry], es_manager: Any) -> None:
    """Every entry's type and ``env_config`` keywords, and that it builds; ``es_manager`` names only entries.

    Raises:
      ValueError: naming the ``custom_envs`` or ``es_manager`` key at fault.
    """
    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ValueError(message)

    for tag, entry in custom_envs.items():
        path = f"{SECTION}.{tag}"
        require(entry.env_type in ENV_TYPES, f"{path}.env_type must be one of {tuple(ENV_TYPES)}, "
                                             f"got {entry.env_type!r}")
        require(entry.max_actions_per_traj >= 1,
                f"{path}.max_actions_per_traj must be >= 1, got {entry.max_actions_per_traj}")
        require(entry.max_tokens >= 1, f"{path}.max_tokens must be >= 1, got {entry.max_tokens}")
        keywords = env_config_types(entry.env_type)
        for name, value in entry.env_config.items():
            require(name in keywords, f"{path}.env_config.{name} is not a keyword of {entry.env_type} "
                                      f"environments; they take {sorted(keywords)}")
            check_value(value, keywords[name], f"{path}.env_config.{name}")
        try:
            envs.make(tag, custom_envs)
        except ValueError as error:
            raise ValueError(f"{path}.env_config: {error}") from error
    for section in ("train", "val"):
        for tag in getattr(es_manager, section).env_configs.tags:
            require(tag in custom_envs,
                    f"es_manager.{section}.env_configs.tags names {tag!r}, which custom_envs does not define "
                    f"(it has {sorted(custom_envs)}): add {SECTION}.{tag}.env_type=<one of {', '.join(ENV_TYPES)}>")
