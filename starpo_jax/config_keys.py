"""RAGEN keys that need more than a type check: the refused ones, LoRA targets and learning-rate schedules.

Every key of ``StarPOConfig`` either changes training (``tests/test_starpo_config_keys.py`` finds each
one read in the library) or is listed in ``REFUSED_KEYS`` with the reason it changes nothing here; a
refused key set to anything but its default stops the run, naming the key, before anything compiles.
"""

from __future__ import annotations

from typing import Any

from starpo_jax.models.lora import ALL_LINEAR

# Keys accepted for RAGEN compatibility that change nothing here: a value other than the default stops the run.
REFUSED_KEYS: dict[str, str] = {
    "trainer.validation_steps": "validation plays es_manager.val once per test_freq (RAGEN's validation_steps=1)",
    "trainer.n_gpus_per_node": "the devices are the mesh's (--mesh data,fsdp,tensor), not a per-node GPU count",
    "trainer.balance_batch": "there are no data-parallel workers to balance: the mesh shards one batch",
    "agent_proxy.action_sep": "responses are split into actions on '||' (envs.text.ACTION_SEP)",
    "algorithm.kl_ctrl.type": "only the fixed KL controller exists (algorithm.kl_ctrl.kl_coef)",
    "collapse_detection.micro_batch_size": "RAGEN-2's chunking of the cross batch it builds; it never changes the "
                                           "metrics, and here the whole cross log-prob matrix is one compiled program",
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def value_at(config: Any, dotted: str) -> Any:
    """The field of ``config`` named by a dotted key."""
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


def check_refused(config: Any) -> None:
    """Raises naming the key when a ``REFUSED_KEYS`` entry of ``config`` differs from its default."""
    default = type(config)()
    for key, reason in REFUSED_KEYS.items():
        value, expected = value_at(config, key), value_at(default, key)
        _require(value == expected, f"{key}={value!r} is not supported ({reason}); leave it at {expected!r}")


def lora_targets(lora: Any) -> tuple[str, ...]:
    """``lora.target_modules`` as projection names: ``all-linear`` or a comma-separated list of PEFT names."""
    value = lora.target_modules.strip().strip("[]")
    if value == "all-linear":
        return ALL_LINEAR
    targets = tuple(name.strip().strip("'\"") for name in value.split(",") if name.strip())
    unknown = sorted(set(targets) - set(ALL_LINEAR))
    _require(bool(targets) and not unknown, f"lora.target_modules must be all-linear or a comma-separated list of "
                                            f"{', '.join(ALL_LINEAR)}; got {lora.target_modules!r}")
    return targets


def validate_optim(optim: Any, path: str) -> None:
    """The schedule keys of an ``OptimConfig`` at ``path``; ``min_lr_ratio`` / ``num_cycles`` need ``cosine``."""
    _require(0.0 <= optim.lr_warmup_steps_ratio <= 1.0,
             f"{path}.lr_warmup_steps_ratio must be in [0, 1], got {optim.lr_warmup_steps_ratio}")
    _require(0.0 <= optim.min_lr_ratio <= 1.0, f"{path}.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    _require(optim.num_cycles > 0, f"{path}.num_cycles must be > 0, got {optim.num_cycles}")
    default = type(optim)()
    cosine_only = [name for name in ("min_lr_ratio", "num_cycles") if getattr(optim, name) != getattr(default, name)]
    _require(optim.warmup_style == "cosine" or not cosine_only,
             f"{path}.{cosine_only[0] if cosine_only else ''} shapes the cosine decay: set "
             f"{path}.warmup_style=cosine")
