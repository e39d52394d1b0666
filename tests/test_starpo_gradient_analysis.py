"""RAGEN-2's gradient analysis (ragen2.md §5): buckets by reward std, per-component gradient norms, trainer wiring."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import TABLES_FILE, MetricWriter, Table, read_jsonl
from runtime.sharding import create_sharded
from starpo_jax.analysis_rollout import analysis_config, scale_group_counts
from starpo_jax.gradient_analysis import bucket_groups, group_rv_tables, make_component_grad_norms
from starpo_jax.iteration import build_learner, update
from starpo_jax.losses import actor_loss
from starpo_jax.models.transformer import CausalLM
from starpo_jax.presets import load_config
from starpo_jax.steps import PolicyBatch, model_token_log_probs
from test_starpo_iteration import MODEL, trajectory
from test_starpo_ragen2_wiring import BASE, V2_FILTER


def test_quantile_and_fixed_buckets():
    std = np.array([0.5, 0.1, 0.9, 0.1, 2.5, 0.3, 7.0])
    quantile = bucket_groups(std, 3, "quantile")  # 7 groups in 3 buckets: 2, 2 and the remaining 3, lowest first
    assert {k: v.tolist() for k, v in quantile.items()} == {"bucket_1": [1, 3], "bucket_2": [0, 5],
                                                            "bucket_3": [2, 4, 6]}
    assert list(bucket_groups(std, 10, "quantile")) == [f"bucket_{i}" for i in range(1, 8)]
    fixed = bucket_groups(std, 6, "fixed_rv")  # [0, 1), [2, 3) and [5, inf); the empty buckets are left out
    assert {k: v.tolist() for k, v in fixed.items()} == {"bucket_1": [0, 1, 2, 3, 5], "bucket_3": [4],
                                                         "bucket_6": [6]}


def test_component_norms_equal_each_term_differentiated_alone():
    config = load_config("starpo-s-grpo", ("actor_rollout_ref.actor.entropy_coeff=0.01",
                                           "actor_rollout_ref.actor.use_kl_loss=True",
                                           "actor_rollout_ref.actor.kl_loss_coef=0.1"))
    actor = config.actor_rollout_ref.actor
    traj = trajectory()
    rng = np.random.default_rng(0)
    shape = traj.loss_mask.shape
    batch = PolicyBatch(jnp.asarray(traj.input_ids), jnp.asarray(traj.attention_mask), jnp.asarray(traj.loss_mask),
                        jnp.asarray(rng.normal(-2, 0.3, shape), jnp.float32), jnp.asarray(rng.normal(size=shape), jnp.float32),
                        jnp.asarray(rng.normal(-2, 0.3, shape), jnp.float32))
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(CausalLM(MODEL, rngs=nnx.Rngs(0)))
    metrics = make_component_grad_norms(graphdef, actor)(params, nnx.State({}), batch)

    def term(p, entropy_coeff, use_kl, part):
        log_probs, entropy = model_token_log_probs(nnx.merge(graphdef, p), batch.input_ids, batch.attention_mask, 1.0)
        out = actor_loss(log_probs, batch.old_log_probs, batch.advantages, batch.loss_mask, entropy, batch.ref_log_probs,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=entropy_coeff,
                         use_kl_loss=use_kl, kl_loss_coef=0.1, loss_agg_mode=actor.loss_agg_mode)
        return {"task": out.loss, "entropy": -0.01 * out.metrics["actor/entropy_loss"],
                "kl": 0.1 * out.metrics.get("actor/kl_loss", 0.0)}[part]

    for part in ("task", "entropy", "kl"):
        want = optax.tree.norm(jax.grad(term)(params, 0.0, part == "kl", part))
        assert metrics[part] == pytest.approx(float(want), rel=1e-4), part
    assert float(metrics["loss/total"]) == pytest.approx(float(metrics["loss/policy"] + metrics["loss/entropy"]
                                                               + metrics["loss/kl"]), rel=1e-5)


def test_update_logs_bucket_norms_before_the_actor_step():
    config = load_config("starpo-s-grpo", BASE + (V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=2",
                                                  "ragen_version=v2", "trainer.gradient_analysis_mode=True",
                                                  "actor_rollout_ref.rollout.gradient_analysis_num_buckets=2"))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(MODEL, lora=None, rngs=nnx.Rngs(0)), mesh)
        learner, actor, _, _ = build_learner(config, policy, None, mesh)
        _, _, metrics = update(actor, None, learner, trajectory(), config, step=0)
    assert metrics["grad_norm/all/sample_count"] == 8 and metrics["grad_norm/all/group_rv_count"] == 2
    low, high = metrics["grad_norm/bucket_1/reward_std_mean"], metrics["grad_norm/bucket_2/reward_std_mean"]
    assert low <= high and metrics["grad_norm/bucket_1/sample_pct"] == 0.5
    assert metrics["actor/grad_norm/task"] == metrics["grad_norm/all/task"] > 0
    assert metrics["grad_norm/all/per_sample/task"] == pytest.approx(metrics["grad_norm/all/task"] / 8)
    # starpo-s-grpo: entropy 0.001 and the KL loss on with coefficient 0, so its gradient norm is 0
    assert metrics["grad_norm/all/entropy"] > 0 and metrics["grad_norm/all/kl"] == 0.0
    with pytest.raises(ValueError, match="set trainer.gradient_analysis_mode=True"):
        load_config("starpo-s-ppo", ("trainer.gradient_analysis_every=10",))


def test_largest_remainder_rescaling_of_the_tags_groups():
    # 7 of (3, 5, 2): floors of 2.1, 3.5, 1.4 are 2, 3, 1; the one left goes to the largest fraction (0.5)
    assert scale_group_counts((3, 5, 2), 7) == (2, 4, 1)
    assert scale_group_counts((1, 3), 2) == (0, 2)  # equal fractions 0.5: the larger base count first
    assert scale_group_counts((1, 1, 2), 2) == (1, 0, 1)  # equal fractions and counts: the earlier tag
    assert scale_group_counts((8,), 128) == (128,)
    shape = BASE + (V2_FILTER + "top_p", "es_manager.train.env_groups=6", "es_manager.train.env_configs.tags="
                    "[SimpleSokoban,FrozenLake]", "es_manager.train.env_configs.n_groups=[4,2]",
                    "trainer.gradient_analysis_mode=True")
    assert analysis_config(load_config("starpo-s-grpo", shape)) is None
    same = ("trainer.gradient_analysis_env_groups=6", "trainer.gradient_analysis_group_size=4")
    assert analysis_config(load_config("starpo-s-grpo", shape + same)) is None  # the training shape, given
    config = load_config("starpo-s-grpo", shape + ("trainer.gradient_analysis_env_groups=4",))
    shaped = analysis_config(config)
    assert (shaped.es_manager.train.env_groups, shaped.es_manager.train.group_size) == (4, 4)
    assert shaped.es_manager.train.env_configs.n_groups == (3, 1)  # 4·4/6 = 2.67, 4·2/6 = 1.33: the 1 left to 2.67
    assert shaped.es_manager.val == config.es_manager.val and shaped.trainer == config.trainer


def test_group_rv_tables_list_each_buckets_groups():
    group_ids = np.repeat([3, 0, 2, 1], 2)
    reward_std = np.repeat([0.9, 0.1, 0.5, 0.3], 2)
    tables = group_rv_tables(group_ids, reward_std, 2, "quantile", prefix="grad_norm_prefilter")
    assert set(tables) == {f"grad_norm_prefilter/{b}/group_rv_table" for b in ("all", "bucket_1", "bucket_2")}
    for name, table in tables.items():
        bucket = name.split("/")[1]
        assert table.columns == ("bucket", "group_id", "reward_std")
        assert all(row[0] == bucket for row in table.rows)
    # the groups sorted by id with their RV: 0 -> 0.1, 1 -> 0.3, 2 -> 0.5, 3 -> 0.9; bucket_1 holds the two lowest
    rows = lambda b: [(g, pytest.approx(r)) for _, g, r in tables[f"grad_norm_prefilter/{b}/group_rv_table"].rows]
    assert rows("bucket_1") == [(0, 0.1), (1, 0.3)] and rows("bucket_2") == [(2, 0.5), (3, 0.9)]
    assert rows("all") == [(0, 0.1), (1, 0.3), (2, 0.5), (3, 0.9)]
    buckets = bucket_groups(np.array([0.1, 0.3, 0.5, 0.9]), 2, "quantile")
    assert [[g for g, _ in rows(b)] for b in buckets] == [v.tolist() for v in buckets.values()]


def test_tables_go_to_their_own_jsonl_and_leave_the_scalar_rows_alone(tmp_path):
    table = Table(("bucket", "group_id", "reward_std"), [("all", 0, 0.5)])
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        assert writer.write(3, {"a": 1.0, "grad_norm/all/group_rv_table": table}) == {"a": 1.0}
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 3, "a": 1.0}]
    assert read_jsonl(tmp_path / TABLES_FILE) == [{"step": 3, "key": "grad_norm/all/group_rv_table",
                                                   "columns": ["bucket", "group_id", "reward_std"],
                                                   "rows": [["all", 0, 0.5]]}]
