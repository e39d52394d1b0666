"""Checkpoint load/export round trips (full, LoRA merged, PEFT adapter, critic) and bad-folder errors."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.models.hf_io import load_pretrained, resolve_folder, save_peft_adapter, save_pretrained
from starpo_jax.models.lora import LoRAConfig, adapters_off
from starpo_jax.models.safetensors_io import SafetensorsIndex
from starpo_hf_fixtures import build_checkpoint, left_padded_batch, torch_logits

LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint written in several shards with an index file."""
    folder = tmp_path_factory.mktemp("qwen2_sharded")
    reference = build_checkpoint("qwen2", folder)
    reference.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").exists()
    return folder, reference


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(1, 2, 4))


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch(np.random.default_rng(5), [7, 3, 5, 1], 7)


def test_load_places_each_tensor_on_its_sharding_and_export_round_trips(checkpoint, mesh, batch, tmp_path):
    folder, reference = checkpoint
    with jax.set_mesh(mesh):
        model = load_pretrained(folder, mesh)
    gate = model.model.layers.mlp.gate_proj.kernel.get_value()
    assert gate.sharding.shard_shape(gate.shape) == (2, 32 // 2, 48 // 4)
    np.testing.assert_array_equal(np.asarray(gate)[1], reference.model.layers[1].mlp.gate_proj.weight.detach().numpy().T)
    tokenizer = train_chat_tokenizer(["<answer> Left </answer>"] * 5, tmp_path / "tokenizer", vocab_size=280)
    save_pretrained(model, tmp_path / "export", tokenizer=tokenizer, max_shard_bytes=30_000)
    assert len(list((tmp_path / "export").glob("model-*.safetensors"))) > 1
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "export").encode("Left") == tokenizer.encode("Left")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokens, mask = batch
    np.testing.assert_array_equal(torch_logits(reloaded, tokens, mask), torch_logits(reference, tokens, mask))


def test_bfloat16_checkpoint_loads_bit_exact(tmp_path, mesh):
    reference = build_checkpoint("llama", tmp_path).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    with jax.set_mesh(mesh):
        model = load_pretrained(tmp_path, mesh, param_dtype="bfloat16", dtype="bfloat16")
    q = np.asarray(model.model.layers.self_attn.q_proj.kernel.get_value())
    assert q.dtype == ml_dtypes.bfloat16
    expected = reference.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T.reshape(32, 4, 8)
    np.testing.assert_array_equal(q[0].astype(np.float32), expected)
    with jax.set_mesh(mesh):  # LoRA on bfloat16 base weights: what trains (adapters, value head) stays float32
        critic = load_pretrained(tmp_path, mesh, critic=True, lora=LORA, param_dtype="bfloat16")
    _, trained, base = nnx.split(critic, nnx.LoRAParam, ...)
    assert {x.dtype for x in jax.tree.leaves(trained)} == {np.dtype(np.float32)}
    assert critic.score.kernel.get_value().dtype == np.float32
    assert critic.model.layers.self_attn.q_proj.kernel.get_value().dtype == ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def lora_model(checkpoint, mesh):
    folder, _ = checkpoint
    with jax.set_mesh(mesh):
        model = load_pretrained(folder, mesh, lora=LORA, seed=1)
    graphdef, lora_state, base = nnx.split(model, nnx.LoRAParam, ...)
    forward = jax.jit(lambda lora, base, t, m: nnx.merge(graphdef, lora, base)(t, m)[0])
    rng = np.random.default_rng(2)
    trained = jax.tree.map(lambda x: jax.device_put(np.asarray(x) + 0.3 * rng.standard_normal(x.shape, np.float32),
                                                    x.sharding), lora_state)
    return graphdef, lora_state, trained, base, forward


def test_lora_with_zero_b_and_adapters_off_equal_the_base(checkpoint, lora_model, batch):
    _, reference = checkpoint
    _, lora_state, trained, base, forward = lora_model
    tokens, mask = batch
    valid = mask.astype(bool)
    expected = torch_logits(reference, tokens, mask)[valid]
    at_init = np.asarray(forward(lora_state, base, tokens, mask))[valid]
    np.testing.assert_allclose(at_init, expected, atol=1e-4, rtol=0)
    off = np.asarray(forward(adapters_off(trained), base, tokens, mask))[valid]
    np.testing.assert_array_equal(off, at_init)


def test_merged_lora_export_and_peft_adapter_equal_unmerged(checkpoint, lora_model, batch, tmp_path):
    folder, _ = checkpoint
    graphdef, _, trained, base, forward = lora_model
    tokens, mask = batch
    valid = mask.astype(bool)
    ours = np.asarray(forward(trained, base, tokens, mask))[valid]
    adapted = nnx.merge(graphdef, trained, base)
    save_pretrained(adapted, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(torch_logits(merged, tokens, mask)[valid], ours, atol=1e-4, rtol=0)
    peft = pytest.importorskip("peft")
    save_peft_adapter(adapted, tmp_path / "adapter", LORA, base_model=str(folder))
    base_torch = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with_adapter = peft.PeftModel.from_pretrained(base_torch, tmp_path / "adapter").eval()
    np.testing.assert_allclose(torch_logits(with_adapter, tokens, mask)[valid], ours, atol=1e-4, rtol=0)


def test_critic_loads_backbone_and_exports_as_token_classification(checkpoint, mesh, batch, tmp_path):
    folder, _ = checkpoint
    with jax.set_mesh(mesh):
        critic = load_pretrained(folder, mesh, critic=True, seed=3)
    graphdef, state = nnx.split(critic)
    tokens, mask = batch
    values, _ = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, m))(state, tokens, mask)
    assert values.shape == tokens.shape and np.asarray(values).std() > 0
    save_pretrained(critic, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    torch_critic = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
    expected = torch_logits(torch_critic, tokens, mask)[..., 0]
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(values)[valid], expected[valid], atol=1e-4, rtol=0)
    with jax.set_mesh(mesh):
        reloaded = load_pretrained(tmp_path, mesh, critic=True, seed=4)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(reloaded), state)


def copy_checkpoint(checkpoint, tmp_path):
    folder, _ = checkpoint
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target


def test_missing_shard_file_is_named(checkpoint, mesh, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_pretrained(folder, mesh)


def test_wrong_shape_names_key_and_file(checkpoint, mesh, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    index = SafetensorsIndex.from_folder(folder)
    key = "model.layers.1.mlp.up_proj.weight"
    file = index.tensors[key].file
    from safetensors.torch import load_file, save_file
    tensors = load_file(file)
    tensors[key] = torch.zeros(47, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{key}.*{file.name}.*\(47, 32\).*\(48, 32\)"):
        load_pretrained(folder, mesh)


def test_missing_and_unexpected_keys_are_named(checkpoint, mesh, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    # the tensor still sits in its shard, so it is both unlisted (fine) and present: drop the file's entry instead
    index = SafetensorsIndex.from_folder(folder)
    assert "model.norm.weight" in index
    from safetensors.torch import load_file, save_file
    file = index.tensors["model.norm.weight"].file
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    tensors["model.extra.weight"] = torch.zeros(3)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_pretrained(folder, mesh)
    tensors["model.norm.weight"] = torch.ones(32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=rf"model.extra.weight.*{file.name}"):
        load_pretrained(folder, mesh)


def test_unknown_architecture_and_missing_folder(checkpoint, mesh, tmp_path):
    folder = copy_checkpoint(checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"], config["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json.*gpt2.*GPT2LMHeadModel"):
        load_pretrained(folder, mesh)
    with pytest.raises(FileNotFoundError, match="nobody/no-such-model"):
        load_pretrained("nobody/no-such-model", mesh)


def test_hub_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path):
    snapshot = tmp_path / "models--tiny--qwen2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--tiny--qwen2" / "refs").mkdir()
    (tmp_path / "models--tiny--qwen2" / "refs" / "main").write_text("0123abcd")
    assert resolve_folder("tiny/qwen2", cache_dir=tmp_path) == snapshot
    with pytest.raises(FileNotFoundError, match="tiny/other"):
        resolve_folder("tiny/other", cache_dir=tmp_path)
