"""The StarPO trainer end to end on a tiny local checkpoint: metrics, checkpoints, export, resume."""

import json

import jax
import pytest
from flax import nnx

import envs
from envs.text import env_prefix, turn_text
from launch import starpo
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import read_jsonl
from runtime.sharding import create_sharded
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.hf_io import save_pretrained
from starpo_jax.models.transformer import CausalLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen")
    bandit = envs.make("Bandit")
    corpus = [env_prefix(bandit) + turn_text(1, "Phoenix Dragon", 1), "<think>x</think><answer>Dragon</answer>"] * 10
    tokenizer = train_chat_tokenizer(corpus, folder / "tok", vocab_size=320)
    config = TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, attention_bias=True,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: CausalLM(config, rngs=nnx.Rngs(0)), mesh)
        save_pretrained(model, folder, tokenizer=tokenizer)
    return folder


def run(checkpoint, out, steps, *extra):
    return starpo.main([
        "--preset", "tiny", "--out", str(out), "--mesh", "1,-1,1", f"model_path={checkpoint}",
        "es_manager.train.env_configs.tags=[Bandit]", "es_manager.val.env_configs.tags=[BanditTest]",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=2", "trainer.save_freq=1",
        "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.max_model_len=1024",
        "agent_proxy.max_turn=1", "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=1", *extra])


def test_trainer_runs_logs_ragen_metrics_checkpoints_and_exports(checkpoint, tmp_path):
    last = run(checkpoint, tmp_path, steps=1)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["step"] == 0 and "val/BanditTest/success" in rows[0]
    assert "val/BanditTest/success" in last and last["timing_s/testing"] > 0  # the last step, though test_freq=2
    for name in ("train/Bandit/success", "actor/pg_loss", "actor/entropy_loss", "actor/grad_norm",
                 "critic/vf_loss", "rollout/in_group_std", "rollout/chosen_in_group_std", "timing_s/gen"):
        assert name in last, name
    assert (tmp_path / "checkpoints" / "1").is_dir()
    val = [json.loads(line) for line in (tmp_path / "rollouts" / "val_step0.jsonl").read_text().splitlines()]
    assert len(val) == 8 and all(r["tag"] == "BanditTest" for r in val)
    assert val[0]["text"].startswith("<|im_start|>system\nYou're a helpful assistant. <|im_end|>")
    exported = json.loads((tmp_path / "hf_model" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2ForCausalLM"]
    last = run(checkpoint, tmp_path, 2, "--allow-change", "trainer.total_training_steps")
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert "val/BanditTest/success" in last


def test_micro_batch_not_dividing_the_devices_is_a_clear_error(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="ppo_mini_batch_size=4 must be a multiple of micro_batch_size_per_gpu=1"):
        starpo.main(["--preset", "tiny", "--out", str(tmp_path), f"model_path={checkpoint}",
                     "micro_batch_size_per_gpu=1"])


def test_fused_driver_validates_like_the_host_driver(checkpoint, tmp_path):
    """``agent_proxy.rollout_driver=fused`` in the trainer: greedy validation equals the host driver's, row by row."""
    sampled_ids = ["train_on_sampled_ids=True", "actor_rollout_ref.rollout.val_kwargs.do_sample=False"]
    for driver in ("host", "fused"):
        last = run(checkpoint, tmp_path / driver, 1, f"agent_proxy.rollout_driver={driver}", *sampled_ids)
        assert "train/Bandit/success" in last and "actor/pg_loss" in last
    host, fused = ((tmp_path / d / "rollouts" / "val_step0.jsonl").read_text() for d in ("host", "fused"))
    assert fused == host and len(host.splitlines()) == 8


def test_preset_defaults_to_ppo_on_a_model_and_to_the_demo_preset_without_one(checkpoint, monkeypatch):
    """No ``--preset``: ``starpo-s-ppo`` (GAE) on ``model_path``; the demo's StarPO-S GRPO without it."""
    from launch import demo_starpo
    seen = {}
    monkeypatch.setattr(starpo, "train", lambda config, mesh, out, **_: seen.update(trainer=config))
    monkeypatch.setattr(demo_starpo, "run", lambda out, mesh, preset, overrides, config: seen.update(demo=preset))
    starpo.main(["--mesh", "1,-1,1", f"model_path={checkpoint}"])
    starpo.main(["--mesh", "1,-1,1"])
    assert seen["trainer"].algorithm.adv_estimator == "gae" and seen["demo"] == "starpo-s-grpo"
    starpo.main(["--preset", "starpo-s-ppo", "--mesh", "1,-1,1"])
    assert seen["demo"] == "starpo-s-ppo"


def test_demo_size_fast_runs_the_test_configuration_and_needs_the_demo(checkpoint, monkeypatch):
    """``--demo-size fast`` (what CI runs) hands the demo ``DemoConfig.fast()``; with ``model_path`` it is refused."""
    from launch import demo_starpo
    seen = {}
    monkeypatch.setattr(demo_starpo, "run", lambda out, mesh, preset, overrides, config: seen.update(config=config))
    starpo.main(["--mesh", "1,-1,1", "--demo-size", "fast"])
    assert seen["config"] == demo_starpo.DemoConfig.fast()
    starpo.main(["--mesh", "1,-1,1"])
    assert seen["config"] == demo_starpo.DemoConfig()
    with pytest.raises(SystemExit):
        starpo.main(["--mesh", "1,-1,1", "--demo-size", "fast", f"model_path={checkpoint}"])
