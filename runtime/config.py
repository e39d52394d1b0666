"""Typed dataclass configs from the command line (tyro), in two spellings.

``--actor.clip_ratio_high 0.2`` (tyro's own form) and RAGEN/Hydra's
``actor.clip_ratio_high=0.2`` both work; ``key=[a,b]`` gives a sequence, Hydra's
``null`` / ``true`` / ``false`` mean ``None`` / ``True`` / ``False``, and booleans
take a value (``use_kl_loss=True``) as in Hydra. Unknown keys and values of the
wrong type exit with a message that names the field, before anything compiles.
``split_section`` and ``value_from_text`` serve keys that a dataclass cannot list
in advance (a mapping whose entries the user names, e.g. RAGEN's ``custom_envs``).
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Sequence, TypeVar

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


def split_section(argv: Sequence[str], section: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Separates the overrides of keys under ``section`` from the other tokens.

    Returns ``(key, text)`` pairs for ``section.key=value``, ``--section.key=value`` and
    ``--section.key value ...`` (several values become ``[a,b]``; a value is a token that
    ``hydra_to_flags`` leaves alone), and the other tokens in order.
    """
    pairs: list[tuple[str, str]] = []
    rest: list[str] = []
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        key = token.removeprefix("--")
        if not key.startswith(section + "."):
            rest.append(token)
        elif "=" in key:
            pairs.append(tuple(key.split("=", 1)))
        elif token.startswith("--"):
            values = []
            while tokens and not tokens[0].startswith("-") and "=" not in tokens[0]:  # as hydra_to_flags reads them
                values.append(tokens.pop(0))
            pairs.append((key, values[0] if len(values) == 1 else "[" + ",".join(values) + "]"))
        else:
            rest.append(token)
    return pairs, rest


def _items(text: str, brackets: str, key: str) -> list[str]:
    if not (text.startswith(brackets[0]) and text.endswith(brackets[1])):
        raise ValueError(f"{key} must be written {brackets[0]}a,b{brackets[1]}, got {text!r}")
    inner = text[1:-1].strip()
    return [item.strip() for item in inner.split(",")] if inner else []


def value_from_text(text: str, annotation: Any, key: str) -> Any:
    """The value of ``annotation`` that an override spells, in Hydra's syntax.

    ``null`` is None (for ``X | None``), ``true`` / ``false`` are booleans, ``[a,b]`` a tuple
    and ``{k:v,...}`` a dict. A string is taken as written, less one pair of enclosing quotes;
    an integer stays an int where a float is expected, as Hydra reads it (``score=1`` is ``1``).

    Raises:
      ValueError: naming ``key`` when ``text`` spells no value of ``annotation``.
    """
    text = text.strip()
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text in ("null", "None") and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return value_from_text(text, option, key)
            except ValueError:
                pass
        raise ValueError(f"{key} must be {annotation}, got {text!r}")
    if annotation is str:
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        return text[1:-1] if quoted else text
    if origin is tuple:
        items = _items(text, "[]", key)
        item_types = [args[0]] * len(items) if args[-1] is Ellipsis else list(args)
        if len(item_types) != len(items):
            raise ValueError(f"{key} must have {len(item_types)} entries, got {text!r}")
        return tuple(value_from_text(item, t, f"{key}[{i}]") for i, (item, t) in enumerate(zip(items, item_types)))
    if origin in (dict, collections.abc.Mapping):
        pairs = [item.split(":", 1) for item in _items(text, "{}", key)]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"{key} must be written {{key:value,...}}, got {text!r}")
        return {value_from_text(k, args[0], key): value_from_text(v, args[1], f"{key}.{k.strip()}") for k, v in pairs}
    try:
        if annotation is bool:
            return {"true": True, "false": False}[text.lower()]
        if annotation is int:
            return int(text)
        if annotation is float:
            return int(text) if text.lstrip("+-").isdigit() else float(text)
    except (KeyError, ValueError):
        raise ValueError(f"{key} must be {annotation.__name__}, got {text!r}") from None
    raise TypeError(f"{key}: values of type {annotation} have no command-line spelling")
