"""Typed dataclass configs from the command line (tyro), in two spellings.

``--actor.clip_ratio_high 0.2`` (tyro's own form) and RAGEN/Hydra's
``actor.clip_ratio_high=0.2`` both work; ``key=[a,b]`` gives a sequence, Hydra's
``null`` / ``true`` / ``false`` mean ``None`` / ``True`` / ``False``, and booleans
take a value (``use_kl_loss=True``) as in Hydra. Unknown keys and values of the
wrong type exit with a message that names the field, before anything compiles.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import tyro

C = TypeVar("C")

HYDRA_LITERALS = {"null": "None", "true": "True", "false": "False"}


def hydra_to_flags(argv: Sequence[str]) -> list[str]:
    """Rewrites ``key=value`` tokens into tyro's ``--key value`` form; other tokens pass through."""
    flags: list[str] = []
    for token in argv:
        if token.startswith("-") or "=" not in token:
            flags.append(token)
            continue
        key, value = token.split("=", 1)
        flags.append("--" + key)
        if value.startswith("[") and value.endswith("]"):
            items = [item.strip() for item in value[1:-1].split(",") if item.strip()]
        else:
            items = [value]
        flags.extend(HYDRA_LITERALS.get(item, item) for item in items)
    return flags


def parse_config(config_type: type[C], default: C, argv: Sequence[str], *, description: str | None = None) -> C:
    """Parses overrides of ``default`` (an instance of ``config_type``) from ``argv``."""
    return tyro.cli(config_type, default=default, args=hydra_to_flags(argv), description=description,
                    config=(tyro.conf.FlagConversionOff,))
