"""Typed StarPO configuration with RAGEN's key names and defaults (starpo.md §16, §20, §22).

The tree mirrors RAGEN's Hydra config (``base.yaml`` + verl's ``ppo_trainer.yaml``), so a
RAGEN override such as ``actor_rollout_ref.actor.clip_ratio_high=0.2`` means the same thing
here. Defaults are StarPO-S (PPO with critic, top 25% of groups by reward std, clip
0.2 / 0.28, no KL) with the choices of starpo.md §22. Every config is a frozen dataclass; ``validate``
checks types and cross-field rules, naming the field, before anything compiles. Names of registered
parts (advantage estimator, policy and critic loss, aggregation mode, KL estimator, score normaliser,
rollout filter) are checked against their registries, so a newly registered name is accepted.
``starpo_jax.presets`` composes the named algorithms from typed presets; user overrides are RAGEN-style
``key=value`` (parsed by ``runtime.config``; booleans take explicit values, ``use_kl_loss=True``, as in Hydra).
``custom_envs`` is RAGEN's environment registry (``config/envs.yaml``, ``envs.registry``); its
overrides, new tags included, are read by ``starpo_jax.custom_envs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from envs.registry import CUSTOM_ENVS, EnvEntry, runs_on_device
from runtime.wandb_logger import LOGGERS, check_loggers
from starpo_jax.advantages import ADVANTAGE_ESTIMATORS
from starpo_jax.config_keys import check_refused, lora_targets, validate_optim
from starpo_jax.config_types import check_types
from starpo_jax.custom_envs import validate_custom_envs
from starpo_jax.filtering import FILTER_TYPES, num_kept_groups
from starpo_jax.losses import CRITIC_LOSSES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from starpo_jax.scores import GROUPINGS, NORMALIZATION_METHODS


@dataclass(frozen=True)
class SeedConfig:
    """HEAD seeding (starpo.md §22.16): train seeds start at 10000 and advance by ``env_groups``."""

    train: int = 10000
    val: int = 123


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters; rank 0 is full fine-tuning (starpo.md §22.29)."""

    rank: int = 0
    alpha: int = 64
    target_modules: str = "all-linear"


@dataclass(frozen=True)
class OptimConfig:
    """AdamW; by default a constant learning rate and no warmup (starpo.md §10).

    verl's schedules by training iteration (``starpo_jax.steps.learning_rate``): ``lr_warmup_steps``
    (``-1``: ``lr_warmup_steps_ratio`` × ``trainer.total_training_steps``) of linear warmup, then ``constant``
    or ``cosine`` decay to ``min_lr_ratio`` × ``lr`` over ``num_cycles`` cosine periods.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_steps: int = -1
    warmup_style: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


@dataclass(frozen=True)
class PolicyLossConfig:
    """verl's ``actor.policy_loss``: ``loss_mode`` names a ``starpo_jax.losses.POLICY_LOSSES`` entry."""

    loss_mode: str = "vanilla"


@dataclass(frozen=True)
class ActorConfig:
    """``actor_rollout_ref.actor``; ``None`` batch sizes follow the top-level keys."""

    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    ppo_epochs: int = 1
    shuffle: bool = False
    use_ref: bool = True
    entropy_coeff: float = 0.001
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "kl"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "seq-mean-token-mean"
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    grad_clip: float = 1.0
    optim: OptimConfig = OptimConfig(lr=1e-6)


@dataclass(frozen=True)
class ValKwargs:
    """Validation sampling: sampled at temperature 0.5 (starpo.md §15)."""

    do_sample: bool = True
    temperature: float = 0.5


@dataclass(frozen=True)
class RolloutConfig:
    """``actor_rollout_ref.rollout``: sampling, length limits and the StarPO-S filter."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: int = 400
    max_model_len: int = 3600
    rollout_filter_ratio: float = 0.25
    rollout_filter_type: str = "std"
    rollout_filter_drop_zero_std: bool = False
    val_kwargs: ValKwargs = ValKwargs()


@dataclass(frozen=True)
class RefConfig:
    """``actor_rollout_ref.ref``; the reference pass is skipped when no KL term is active (starpo.md §22.9)."""

    force_ref_log_prob: bool = False


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    ref: RefConfig = RefConfig()


@dataclass(frozen=True)
class CriticConfig:
    """verl critic: value clipping 0.5, grad clip 1.0, lr 1e-5.

    ``loss_agg_mode`` ``seq-mean-token-mean`` is RAGEN HEAD's (and V2's) critic loss: the masked token
    mean of each micro-batch of one trajectory, averaged over the micro-batches.
    """

    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "seq-mean-token-mean"
    loss_mode: str = "clipped"  # a starpo_jax.losses.CRITIC_LOSSES entry
    grad_clip: float = 1.0
    optim: OptimConfig = OptimConfig(lr=1e-5)


@dataclass(frozen=True)
class KlCtrlConfig:
    type: Literal["fixed"] = "fixed"
    kl_coef: float = 0.0


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimator and KL-in-reward (explicit HEAD flag, starpo.md §22.8)."""

    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"  # a starpo_jax.advantages.ADVANTAGE_ESTIMATORS entry
    high_level_gamma: float = 0.95
    bi_level_gae: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KlCtrlConfig = KlCtrlConfig()
    use_kl_in_reward: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "ragen_latest"
    experiment_name: str = "test"
    total_training_steps: int = 200
    test_freq: int = 10  # validate every test_freq iterations; <= 0: never (RAGEN / verl)
    save_freq: int = -1
    val_before_train: bool = True
    validation_steps: int = 1
    n_gpus_per_node: int = 1
    balance_batch: bool = True
    critic_warmup: int = 0
    max_consecutive_non_finite: int = 5  # stop (after saving) when this many updates in a row were skipped
    logger: tuple[Literal[LOGGERS], ...] = ("console",)  # RAGEN's [console,wandb]; wandb is optional


@dataclass(frozen=True)
class RewardNormalizationConfig:
    grouping: Literal[GROUPINGS] = "state"
    method: str = "identity"


@dataclass(frozen=True)
class AgentProxyConfig:
    max_context_window: int = -1
    max_turn: int = 5
    action_sep: str = "||"
    max_actions_per_turn: int = 5
    use_turn_scores: bool = False
    enable_think: bool = True
    reward_normalization: RewardNormalizationConfig = RewardNormalizationConfig()
    rollout_driver: str = "host"  # a starpo_jax.rollout_drivers.ROLLOUT_DRIVERS name; fused: JAX envs, sampled ids


@dataclass(frozen=True)
class EnvConfigs:
    tags: tuple[str, ...] = ("SimpleSokoban",)
    n_groups: tuple[int, ...] = (8,)


@dataclass(frozen=True)
class EnvGroupsConfig:
    """``env_groups`` initial states × ``group_size`` rollouts each, split over env tags."""

    env_groups: int = 8
    group_size: int = 16
    env_configs: EnvConfigs = EnvConfigs()


@dataclass(frozen=True)
class EsManagerConfig:
    format_penalty: float = -0.1
    train: EnvGroupsConfig = EnvGroupsConfig()
    val: EnvGroupsConfig = EnvGroupsConfig(256, 1, EnvConfigs(("SimpleSokoban",), (256,)))


@dataclass(frozen=True)
class StarPOConfig:
    """Top level of RAGEN's ``base.yaml`` plus the switches of starpo.md §22.3, §22.10."""

    model_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    micro_batch_size_per_gpu: int = 4
    ppo_mini_batch_size: int = 32
    enable_response_mask: bool = True
    mask_alignment: Literal["reference", "standard"] = "reference"
    train_on_sampled_ids: bool | None = None  # None: True for agent_proxy.rollout_driver=fused (``resolve``)
    grpo_advantage_length_weight: bool = False
    # Policy and critic: compute dtype (parameters and optimizer states stay float32), per-layer
    # rematerialisation in the backward pass (verl's enable_gradient_checkpointing) and queries per
    # attention block (0: all at once; ``starpo_jax.models.transformer.attend``).
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    attention_chunk: int = 0
    seed: SeedConfig = SeedConfig()
    lora: LoraConfig = LoraConfig()
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    critic: CriticConfig = CriticConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    agent_proxy: AgentProxyConfig = AgentProxyConfig()
    es_manager: EsManagerConfig = EsManagerConfig()
    # Parsed apart from the tree (``starpo_jax.custom_envs``): its tags are the user's to name.
    custom_envs: Annotated[Mapping[str, EnvEntry], tyro.conf.Suppress] = dataclasses.field(
        default_factory=lambda: dict(CUSTOM_ENVS))

    @property
    def use_critic(self) -> bool:
        """Whether the advantage estimator declares that it needs a critic (GAE does, GRPO does not)."""
        return ADVANTAGE_ESTIMATORS.get(self.algorithm.adv_estimator).needs_critic

    @property
    def needs_ref_log_prob(self) -> bool:
        """Whether any KL term (or the parity flag) needs the reference model's log-probs."""
        actor, algorithm = self.actor_rollout_ref.actor, self.algorithm
        kl_loss = actor.use_kl_loss and actor.kl_loss_coef > 0
        kl_reward = algorithm.use_kl_in_reward and algorithm.kl_ctrl.kl_coef > 0
        estimator = ADVANTAGE_ESTIMATORS.get(self.algorithm.adv_estimator).needs_ref_log_probs
        return actor.use_ref and (kl_loss or kl_reward or estimator or self.actor_rollout_ref.ref.force_ref_log_prob)


def resolve(config: StarPOConfig) -> StarPOConfig:
    """Fills the actor and critic batch sizes that follow the top-level keys (RAGEN's interpolations)."""
    def follow(section):
        mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
        return dataclasses.replace(
            section, ppo_mini_batch_size=config.ppo_mini_batch_size if mini is None else mini,
            ppo_micro_batch_size_per_gpu=config.micro_batch_size_per_gpu if micro is None else micro)

    actor_rollout_ref = dataclasses.replace(config.actor_rollout_ref, actor=follow(config.actor_rollout_ref.actor))
    sampled_ids = config.train_on_sampled_ids
    if sampled_ids is None:  # the fused driver generates from and trains on the sampled ids (starpo.md §22.10)
        sampled_ids = config.agent_proxy.rollout_driver == "fused"
    return dataclasses.replace(config, actor_rollout_ref=actor_rollout_ref, critic=follow(config.critic),
                               train_on_sampled_ids=sampled_ids)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _validate_env_groups(groups: EnvGroupsConfig, path: str) -> None:
    _require(groups.env_groups >= 1, f"{path}.env_groups must be >= 1, got {groups.env_groups}")
    _require(groups.group_size >= 1, f"{path}.group_size must be >= 1, got {groups.group_size}")
    tags, n_groups = groups.env_configs.tags, groups.env_configs.n_groups
    _require(len(tags) >= 1 and len(tags) == len(n_groups),
             f"{path}.env_configs.tags and n_groups must be non-empty and of equal length, got {tags} and {n_groups}")
    _require(sum(n_groups) == groups.env_groups,
             f"{path}.env_configs.n_groups must sum to {path}.env_groups={groups.env_groups}, got {n_groups}")


def _validate_batches(config: StarPOConfig) -> None:
    train = config.es_manager.train
    rollout = config.actor_rollout_ref.rollout
    ratio = rollout.rollout_filter_ratio
    _require(0.0 < ratio <= 1.0, f"actor_rollout_ref.rollout.rollout_filter_ratio must be in (0, 1], got {ratio}")
    _require(ratio == 1.0 or train.group_size >= 2,
             f"es_manager.train.group_size must be >= 2 to filter groups by reward std, got {train.group_size}")
    kept_samples = num_kept_groups(train.env_groups, ratio) * train.group_size
    for path, section in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor), ("critic", config.critic)):
        mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
        _require(mini is not None and mini >= 1, f"{path}.ppo_mini_batch_size must be >= 1, got {mini}")
        _require(micro is not None and micro >= 1 and mini % micro == 0,
                 f"{path}.ppo_micro_batch_size_per_gpu={micro} must divide {path}.ppo_mini_batch_size={mini}")
        _require(train.env_groups * train.group_size * ratio >= mini,
                 f"es_manager.train.env_groups·group_size·actor_rollout_ref.rollout.rollout_filter_ratio = "
                 f"{train.env_groups}·{train.group_size}·{ratio} leaves less than one "
                 f"{path}.ppo_mini_batch_size={mini}")
        _require(kept_samples % mini == 0,
                 f"the filtered batch of {kept_samples} trajectories (es_manager.train.env_groups·group_size·"
                 f"rollout_filter_ratio) is not divisible by {path}.ppo_mini_batch_size={mini}")
        _require(section.ppo_epochs >= 1, f"{path}.ppo_epochs must be >= 1, got {section.ppo_epochs}")
        _require(section.grad_clip > 0, f"{path}.grad_clip must be > 0, got {section.grad_clip}")
        _require(section.optim.lr > 0, f"{path}.optim.lr must be > 0, got {section.optim.lr}")
        _require(section.optim.weight_decay >= 0, f"{path}.optim.weight_decay must be >= 0")
        validate_optim(section.optim, f"{path}.optim")


def _validate_names(config: StarPOConfig) -> None:
    """Every name of a registered part is registered; the error names the key and the registered names."""
    from starpo_jax.rollout_drivers import ROLLOUT_DRIVERS  # it builds on this module's config types

    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    for registry, key, name in (
            (ADVANTAGE_ESTIMATORS, "algorithm.adv_estimator", algorithm.adv_estimator),
            (KL_ESTIMATORS, "algorithm.kl_penalty", algorithm.kl_penalty),
            (KL_ESTIMATORS, "actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
            (LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode),
            (LOSS_AGG_MODES, "critic.loss_agg_mode", config.critic.loss_agg_mode),
            (POLICY_LOSSES, "actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode),
            (CRITIC_LOSSES, "critic.loss_mode", config.critic.loss_mode),
            (FILTER_TYPES, "actor_rollout_ref.rollout.rollout_filter_type",
             config.actor_rollout_ref.rollout.rollout_filter_type),
            (NORMALIZATION_METHODS, "agent_proxy.reward_normalization.method",
             config.agent_proxy.reward_normalization.method),
            (ROLLOUT_DRIVERS, "agent_proxy.rollout_driver", config.agent_proxy.rollout_driver)):
        registry.check(name, key)


def _validate_algorithm(config: StarPOConfig) -> None:
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    _require(0.0 <= actor.clip_ratio_low < 1.0, f"actor_rollout_ref.actor.clip_ratio_low must be in [0, 1), "
                                                f"got {actor.clip_ratio_low}")
    _require(actor.clip_ratio_high >= 0.0, f"actor_rollout_ref.actor.clip_ratio_high must be >= 0, "
                                           f"got {actor.clip_ratio_high}")
    _require(actor.clip_ratio_c is None or actor.clip_ratio_c > 1.0,
             f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 or null, got {actor.clip_ratio_c}")
    for path, value in (("algorithm.gamma", algorithm.gamma), ("algorithm.lam", algorithm.lam),
                        ("algorithm.high_level_gamma", algorithm.high_level_gamma)):
        _require(0.0 <= value <= 1.0, f"{path} must be in [0, 1], got {value}")
    _require(actor.kl_loss_coef >= 0 and algorithm.kl_ctrl.kl_coef >= 0,
             "actor_rollout_ref.actor.kl_loss_coef and algorithm.kl_ctrl.kl_coef must be >= 0")
    _require(not (actor.use_kl_loss or algorithm.use_kl_in_reward) or actor.use_ref,
             "actor_rollout_ref.actor.use_ref must be True when a KL term (use_kl_loss / use_kl_in_reward) is on")
    bi_level_ok = algorithm.adv_estimator == "gae" and not config.agent_proxy.use_turn_scores
    _require(not algorithm.bi_level_gae or bi_level_ok,
             "algorithm.bi_level_gae requires algorithm.adv_estimator=gae and agent_proxy.use_turn_scores=False")
    _require(not config.grpo_advantage_length_weight or algorithm.adv_estimator == "grpo",
             "grpo_advantage_length_weight requires algorithm.adv_estimator=grpo")


def _validate_rollout(config: StarPOConfig) -> None:
    rollout, proxy = config.actor_rollout_ref.rollout, config.agent_proxy
    _require(rollout.temperature > 0, f"actor_rollout_ref.rollout.temperature must be > 0, got {rollout.temperature}")
    _require(rollout.val_kwargs.temperature > 0, "actor_rollout_ref.rollout.val_kwargs.temperature must be > 0")
    _require(0.0 < rollout.top_p <= 1.0, f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {rollout.top_p}")
    _require(rollout.response_length >= 1, "actor_rollout_ref.rollout.response_length must be >= 1")
    _require(rollout.max_model_len > rollout.response_length,
             f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} must exceed "
             f"actor_rollout_ref.rollout.response_length={rollout.response_length}")
    _require(proxy.max_turn >= 1, f"agent_proxy.max_turn must be >= 1, got {proxy.max_turn}")
    _require(proxy.max_actions_per_turn >= 1, "agent_proxy.max_actions_per_turn must be >= 1")
    _require(proxy.max_context_window == -1 or proxy.max_context_window >= 1,
             f"agent_proxy.max_context_window must be -1 or >= 1, got {proxy.max_context_window}")
    if proxy.rollout_driver == "fused":
        tags = config.es_manager.train.env_configs.tags + config.es_manager.val.env_configs.tags
        host_only = [t for t in tags if not runs_on_device(config.custom_envs[t].env_type)]
        _require(not host_only, f"agent_proxy.rollout_driver=fused steps JAX environments on device; {host_only} "
                                f"are host-only (Countdown): use agent_proxy.rollout_driver=host")
        _require(config.train_on_sampled_ids is not False,
                 "agent_proxy.rollout_driver=fused requires train_on_sampled_ids=True (its default there): it cannot "
                 "re-render RAGEN's cleaned chat on device (re-tokenising a cleaned response needs the tokenizer's "
                 "merges), so it generates from and trains on the sampled ids (starpo.md §22.10); use "
                 "agent_proxy.rollout_driver=host for RAGEN's cleaned turns")
        _require(proxy.max_context_window == -1,
                 "agent_proxy.rollout_driver=fused does not support agent_proxy.max_context_window: the cut history "
                 "is re-rendered each turn, so the trajectory is not the one sampled id sequence the fused driver "
                 "trains on; use agent_proxy.rollout_driver=host")
    _require(proxy.max_context_window == -1 or not config.train_on_sampled_ids,
             "agent_proxy.max_context_window re-renders the cut history each turn, so the trajectory is not one "
             "sampled id sequence: set train_on_sampled_ids=False")


def validate(config: StarPOConfig) -> StarPOConfig:
    """Checks every field's type and the cross-field rules of RAGEN's ``train.py``; returns ``config``."""
    check_types(config)
    _validate_names(config)
    _require(config.trainer.total_training_steps >= 1, f"trainer.total_training_steps must be >= 1, "
                                                       f"got {config.trainer.total_training_steps}")
    _require(config.trainer.max_consecutive_non_finite >= 1, f"trainer.max_consecutive_non_finite must be >= 1, "
                                                             f"got {config.trainer.max_consecutive_non_finite}")
    check_loggers(config.trainer.logger)
    check_refused(config)
    if config.lora.rank:
        lora_targets(config.lora)
    changed = [f"lora.{k}" for k in ("alpha", "target_modules") if getattr(config.lora, k) != getattr(LoraConfig(), k)]
    _require(config.lora.rank > 0 or not changed, f"{', '.join(changed)} shape(s) LoRA adapters: set lora.rank > 0")
    warmup = config.trainer.critic_warmup
    _require(warmup >= 0, f"trainer.critic_warmup must be >= 0, got {warmup}")
    _validate_env_groups(config.es_manager.train, "es_manager.train")
    _validate_env_groups(config.es_manager.val, "es_manager.val")
    validate_custom_envs(config.custom_envs, config.es_manager)
    _validate_batches(config)
    _validate_algorithm(config)
    _validate_rollout(config)
    return config
