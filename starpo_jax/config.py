"""Typed StarPO configuration with RAGEN's key names and defaults (starpo.md §16, §20, §22).

The tree mirrors RAGEN's Hydra config (``base.yaml`` + verl's ``ppo_trainer.yaml``), so a
RAGEN override such as ``actor_rollout_ref.actor.clip_ratio_high=0.2`` means the same thing
here. Defaults are StarPO-S (PPO with critic, top 25% of groups by reward std, clip
0.2 / 0.28, no KL) with the choices of starpo.md §22. Every config is a frozen dataclass;
``starpo_jax.config_checks.validate`` checks types and cross-field rules, naming the field, before anything
compiles.
``starpo_jax.presets`` composes the named algorithms from typed presets; user overrides are RAGEN-style
``key=value`` (parsed by ``runtime.config``; booleans take explicit values, ``use_kl_loss=True``, as in Hydra).
``custom_envs`` is RAGEN's environment registry (``config/envs.yaml``, ``envs.registry``); its
overrides, new tags included, are read by ``starpo_jax.custom_envs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import tyro

from envs.registry import CUSTOM_ENVS, EnvEntry
from runtime.wandb_logger import LOGGERS
from starpo_jax.advantages import ADVANTAGE_ESTIMATORS
from starpo_jax.collapse_config import CollapseDetectionConfig
from starpo_jax.scores import GROUPINGS


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
    filter_loss_scaling: Literal["none", "linear", "sqrt"] = "none"  # RAGEN-2: advantages × 1, ρ or √ρ (kept ratio)
    optim: OptimConfig = OptimConfig(lr=1e-6)


@dataclass(frozen=True)
class ValKwargs:
    """Validation sampling: sampled at temperature 0.5 (starpo.md §15)."""

    do_sample: bool = True
    temperature: float = 0.5


@dataclass(frozen=True)
class RolloutConfig:
    """``actor_rollout_ref.rollout``: sampling, length limits and the rollout filter.

    ``rollout_filter_strategy`` names a ``starpo_jax.group_filters.ROLLOUT_FILTERS`` entry: ``starpo_s`` (the
    paper's fixed top ``rollout_filter_ratio`` of groups by reward std, ``rollout_filter_type`` ``std`` /
    ``std_rev``) or RAGEN-2's SNR-aware ``top_p`` / ``top_k`` / ``top_k_abs`` / ``min_p`` (ragen2.md §4.2,
    ``rollout_filter_value`` …, ``rollout_filter_type`` ``largest`` / ``smallest``). Keys of the other family
    must stay at their defaults.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    response_length: int = 400
    max_model_len: int = 3600
    rollout_filter_ratio: float = 0.25
    rollout_filter_type: str = "std"
    rollout_filter_drop_zero_std: bool = False
    rollout_filter_strategy: str = "starpo_s"
    rollout_filter_value: float = 1.0
    rollout_filter_include_zero: bool = True
    rollout_filter_top_p_prob_mode: Literal["linear", "softmax"] = "linear"
    rollout_filter_selection_eps: float = 0.01
    rollout_filter_metric: str = "reward_variance"
    rollout_filter_empty_stop_steps: int = 5
    gradient_analysis_num_buckets: int = 6  # RAGEN-2's gradient analysis (trainer.gradient_analysis_mode)
    gradient_analysis_bucket_mode: Literal["quantile", "fixed_rv"] = "quantile"
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
    norm_adv_by_std_in_grpo: bool = True  # RAGEN-2 (ragen_version=v2): False is Dr. GRPO, A = R − mean
    soft_advantage_reweight: bool = False  # RAGEN-2, GRPO: advantages × σ_g / max σ


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "ragen_latest"
    experiment_name: str = "test"
    total_training_steps: int = 200
    test_freq: int = 10  # validate every test_freq iterations and after the last; <= 0: never (RAGEN / verl)
    save_freq: int = -1
    val_before_train: bool = True
    validation_steps: int = 1
    n_gpus_per_node: int = 1
    balance_batch: bool = True
    critic_warmup: int = 0
    max_consecutive_non_finite: int = 5  # stop (after saving) when this many updates in a row were skipped
    logger: tuple[Literal[LOGGERS], ...] = ("console",)  # RAGEN's [console,wandb]; wandb is optional
    # RAGEN-2's hard-coded early stops (ragen2.md §4.8, §12.11), here switches (on in the v2 presets).
    early_stop_reward_variance_collapse: bool = False
    early_stop_low_validation_success: bool = False
    # RAGEN-2's gradient analysis (starpo_jax.gradient_analysis): per-bucket component gradient norms at steps
    # 1, 1 + every, … before the actor update, without an optimizer step.
    gradient_analysis_mode: bool = False
    gradient_analysis_every: int = 50
    # A separate analysis rollout of this shape when either differs from es_manager.train's (None: the training's).
    gradient_analysis_env_groups: int | None = None
    gradient_analysis_group_size: int | None = None
    gradient_analysis_log_prefilter: bool = False  # also analyse the separate batch before its filter
    gradient_analysis_only: bool = False  # probe: no critic or actor update
    exit_after_gradient_analysis: bool = False  # end the run right after the first analysis


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
    # RAGEN-2's prompt (ragen2.md §6.6-6.7; starpo_jax.trajectory.validate_prompt_keys): v1 = the environment
    # prefix in the first user message; v2 = in the system message, plus the invalid-action warning when sampling.
    prompt_layout: str = "v1"
    # RAGEN-2's key: full, or one sample per turn (limited_multi_turn / single_turn; starpo_jax.turn_samples).
    context_window_mode: str = "full"
    batch_adjust_mode: Literal["copy", "delete"] = "copy"  # RAGEN-2: a filtered batch to a multiple of the divisor


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
    """Top level of RAGEN's ``base.yaml`` plus the switches of starpo.md §22.3, §22.10.

    ``ragen_version`` selects the semantics RAGEN-2 changed without a key of its own (ragen2.md §2): ``v2``
    runs GRPO per initial-state group in the trainer (``algorithm.norm_adv_by_std_in_grpo``) and GAE's
    recursion over response positions only. The ``v2`` presets (``starpo_jax.ragen2_presets``) set it together
    with RAGEN-2's defaults.
    """

    ragen_version: Literal["v1", "v2"] = "v1"
    model_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    micro_batch_size_per_gpu: int = 4
    ppo_mini_batch_size: int = 32
    enable_response_mask: bool = True
    mask_alignment: Literal["reference", "standard"] = "reference"
    train_on_sampled_ids: bool | None = None  # None: True for agent_proxy.rollout_driver=fused (``resolve``)
    grpo_advantage_length_weight: bool = False
    # Policy and critic: compute dtype (parameters and optimizer states stay float32), storage dtype of
    # the frozen base weights (bfloat16 only with LoRA: adapters, value head and optimizer states stay
    # float32), per-layer rematerialisation in the backward pass (verl's enable_gradient_checkpointing)
    # and queries per attention block (0: all at once; ``starpo_jax.models.transformer.attend``).
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False
    attention_chunk: int = 0
    # The fused driver plays each rollout as this many programs over equal parts of every tag's rows, run
    # concurrently (``starpo_jax.fused_rollout``): the same trajectories, more of a CPU's cores busy.
    rollout_chunks: int = 1
    seed: SeedConfig = SeedConfig()
    lora: LoraConfig = LoraConfig()
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    critic: CriticConfig = CriticConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    agent_proxy: AgentProxyConfig = AgentProxyConfig()
    es_manager: EsManagerConfig = EsManagerConfig()
    collapse_detection: CollapseDetectionConfig = CollapseDetectionConfig()
    # Parsed apart from the tree (``starpo_jax.custom_envs``): its tags are the user's to name.
    custom_envs: Annotated[Mapping[str, EnvEntry], tyro.conf.Suppress] = dataclasses.field(
        default_factory=lambda: dict(CUSTOM_ENVS))

    @property
    def numerics(self) -> dict[str, Any]:
        """The model's numerics this run sets: keyword arguments of ``TransformerConfig`` and ``load_pretrained``."""
        return dict(dtype=self.dtype, param_dtype=self.param_dtype, remat=self.remat,
                    attention_chunk=self.attention_chunk)

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
