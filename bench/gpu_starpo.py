"""One StarPO-S iteration on Qwen2.5-0.5B-sized random weights: generated tokens/s, training tokens/s, MFU.

    python -m bench.gpu_starpo            # one GPU (H200: a few minutes, mostly compilation)
    python -m bench.gpu_starpo --tiny     # CPU smoke run of the same code path

Rollout: ``env_groups × group_size`` random prompts decoded by the compiled sampler for
``response_length`` tokens (no stop token, so every row generates the full length).
Update: the prompts plus their responses as a trajectory batch with random group-structured
scores, through ``starpo_jax.iteration.update`` with the ``starpo-s-ppo`` preset (normalise,
top-25 % reward-std filter, old log-probs, values, GAE, critic step, actor step). Each phase runs
twice; the second run is timed. Random weights never emit the stop token, so the environments are
left out: their host-side cost is measured in ``bench/bench_envs.py``.

Model FLOPs (PaLM appendix B convention, attention over the full context, not halved for causality):
  forward per token  F = 2·P_matmul + 4·layers·heads·head_dim·context
  P_matmul = layers·(2·d·heads·head_dim + 2·d·kv_heads·head_dim + 3·d·mlp) + d·V (LM head; d for a critic)
  generation = Σ_prompt tokens F_backbone(prompt) + Σ_generated tokens F(context so far)
  update     = tokens_kept · (4·F_actor + 4·F_critic)   (old log-prob and value forwards, then forward +
               backward = 3 forwards each for the critic and actor steps; no reference pass without KL)
MFU = model FLOPs / (seconds · peak); peak default 989.5 TFLOP/s = H200 SXM dense BF16.

Peer (``--peer``, needs torch and transformers): the same work in the same process with Hugging Face
``transformers``' PyTorch Qwen2 of the same shape (fp32 weights, bf16 autocast): ``generate`` on the
same prompts for the same number of sampled tokens, and the update's passes on as many rows as the
filter kept (policy and critic forwards, then a critic and an actor step of fwd + bwd over the same
micro-batches, clip, AdamW). It prints ours / peer for both throughputs. JAX is capped at half the device memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set) so both fit.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import hygiene
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import create_sharded
from starpo_jax.filtering import num_kept_groups
from starpo_jax.iteration import build_learner, update
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.presets import load_config
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import Trajectory, position_ids

H200_BF16_PEAK_TFLOPS = 989.5


def qwen25_05b(dtype: str, param_dtype: str) -> TransformerConfig:
    """Qwen2.5-0.5B-Instruct's shape (config.json of the HF release)."""
    return TransformerConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                             num_kv_heads=2, head_dim=64, rope_theta=1e6, attention_bias=True, tie_word_embeddings=True,
                             dtype=dtype, param_dtype=param_dtype)


def tiny(dtype: str, param_dtype: str) -> TransformerConfig:
    return TransformerConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True,
                             dtype=dtype, param_dtype=param_dtype)


def matmul_params(c: TransformerConfig, head_out: int) -> int:
    """Weights multiplied per token: attention and MLP projections of every layer plus the output head."""
    per_layer = 2 * c.hidden_size * c.num_heads * c.head_dim + 2 * c.hidden_size * c.num_kv_heads * c.head_dim \
        + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + c.hidden_size * head_out


def forward_flops(c: TransformerConfig, head_out: int, context: int) -> float:
    """Forward FLOPs of one token attending to ``context`` positions."""
    return 2.0 * matmul_params(c, head_out) + 4.0 * c.num_layers * c.num_heads * c.head_dim * context


def timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def torch_peer(c: TransformerConfig, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, train_ids: np.ndarray,
               train_attention: np.ndarray, train_mask: np.ndarray, micro_rows: int) -> tuple[float, float, str]:
    """Seconds of ``transformers``' Qwen2 for the same generation and update (second of two runs each), and versions."""
    import torch
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fields = {k: v for k, v in c.to_hf().items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    hf = transformers.AutoConfig.for_model(c.model_type, **fields)
    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_config(hf).to(device)
    backbone = transformers.AutoModel.from_config(hf).to(device)
    value_head = torch.nn.Linear(c.hidden_size, 1).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    ids, attention = torch.tensor(tokens, device=device), torch.tensor(mask, device=device)

    stop = c.eos_ids[0] if c.eos_ids else c.vocab_size - 1  # suppressed by min_new_tokens: full-length rows

    def generate(length: int):
        with torch.no_grad(), autocast:
            return policy.generate(input_ids=ids, attention_mask=attention, max_new_tokens=length,
                                   min_new_tokens=length, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   eos_token_id=stop, pad_token_id=c.pad_token_id)

    generate(8)
    sync()
    clock = time.perf_counter()
    generate(new_tokens)
    sync()
    gen_s = time.perf_counter() - clock

    rows, targets = torch.tensor(train_ids, device=device), torch.tensor(train_mask, device=device)
    row_attention = torch.tensor(train_attention, device=device)
    scores = torch.randn(targets.shape, device=device)

    def token_log_probs(x, m):
        logits = policy(input_ids=x, attention_mask=m).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]

    def values(x, m):
        return value_head(backbone(input_ids=x, attention_mask=m).last_hidden_state[:, :-1]).float()[..., 0]

    actor_opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    critic_opt = torch.optim.AdamW([*backbone.parameters(), *value_head.parameters()], lr=1e-5)
    chunks = [slice(i, i + micro_rows) for i in range(0, rows.shape[0], micro_rows)]

    def update():
        with torch.no_grad(), autocast:
            old = torch.cat([token_log_probs(rows[s], row_attention[s]) for s in chunks])
            returns = torch.cat([values(rows[s], row_attention[s]) for s in chunks]) + scores
        for opt, params, loss_of in (
                (critic_opt, [*backbone.parameters(), *value_head.parameters()],
                 lambda s: (values(rows[s], row_attention[s]) - returns[s]) ** 2),
                (actor_opt, list(policy.parameters()),
                 lambda s: -torch.exp(token_log_probs(rows[s], row_attention[s]) - old[s]) * scores[s])):
            opt.zero_grad(set_to_none=True)
            for s in chunks:
                with autocast:
                    loss = (loss_of(s) * targets[s]).sum() / targets.sum()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

    update()
    sync()
    clock = time.perf_counter()
    update()
    sync()
    return gen_s, time.perf_counter() - clock, f"transformers {transformers.__version__}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model and batch (CPU smoke run)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per row (default 512; tiny 32)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype")
    parser.add_argument("--param-dtype", default="float32", help="parameter dtype (RAGEN: fp32 master weights)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    parser.add_argument("--peer", action="store_true", help="also run transformers' PyTorch Qwen2 on the same work")
    parser.add_argument("overrides", nargs="*", help="RAGEN key=value overrides of the starpo-s-ppo preset")
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    config = load_config("tiny" if args.tiny else "starpo-s-ppo", args.overrides)
    model = (tiny if args.tiny else qwen25_05b)(args.dtype, args.param_dtype)
    prompt = args.prompt or (32 if args.tiny else 512)
    groups, group_size = config.es_manager.train.env_groups, config.es_manager.train.group_size
    rows, new_tokens = groups * group_size, config.actor_rollout_ref.rollout.response_length
    device = jax.devices()[0]
    mesh = make_mesh(MeshConfig(1, 1, 1), [device])
    print(f"device: {device.device_kind} ({device.platform}); model: {model.num_layers} layers, d {model.hidden_size}, "
          f"vocab {model.vocab_size}, {args.dtype} compute / {args.param_dtype} params")

    with jax.set_mesh(mesh):
        clock = time.perf_counter()
        policy = create_sharded(lambda: CausalLM(model, rngs=nnx.Rngs(0)), mesh)
        critic = create_sharded(lambda: Critic(model, rngs=nnx.Rngs(1)), mesh)
        learner, actor, critic_state, graphdef = build_learner(config, policy, critic, mesh)
        count = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
        print(f"parameters: {count / 1e6:.1f}M; init {time.perf_counter() - clock:.1f} s")
        sampler = make_sampler(graphdef, SamplerConfig(new_tokens, temperature=1.0), mesh=mesh)
        params = nnx.merge_state(actor.params, learner.actor_frozen)
        rng = np.random.default_rng(0)
        lengths = rng.integers(prompt // 2, prompt + 1, rows)
        mask = (np.arange(prompt)[None, :] >= prompt - lengths[:, None]).astype(np.int32)
        tokens = np.where(mask, rng.integers(0, model.vocab_size, (rows, prompt)), 0).astype(np.int32)
        active = jnp.ones((rows,), bool)

        def generate(key):
            cache = init_cache(model, rows, prompt + new_tokens, mesh=mesh)
            return sampler(params, tokens, mask, cache, key, active)

        _, compile_gen = timed(generate, jax.random.key(0))
        sample, gen_s = timed(generate, jax.random.key(1))
        generated = int(np.sum(jax.device_get(sample.lengths)))
        gen_flops = float(np.sum(lengths)) * forward_flops(model, 0, prompt) + rows * sum(
            forward_flops(model, model.vocab_size, prompt + t) for t in range(new_tokens))

        ids = np.concatenate([tokens, np.asarray(jax.device_get(sample.tokens))], axis=1)
        attention = np.concatenate([mask, np.ones((rows, new_tokens), np.int32)], axis=1)
        loss_mask = np.zeros((rows, ids.shape[1] - 1), np.float32)
        loss_mask[:, prompt - 1:] = 1.0  # position j scores token j + 1: every generated token
        success = rng.random((groups, group_size)) < rng.random((groups, 1))
        traj = Trajectory(ids, attention, position_ids(attention), loss_mask,
                          success.reshape(-1).astype(np.float32), np.zeros(rows, np.float32),
                          np.repeat(np.arange(groups), group_size).astype(np.int32), np.zeros(rows, np.int32))
        clock = time.perf_counter()
        actor, critic_state, _ = update(actor, critic_state, learner, traj, config)
        compile_update = time.perf_counter() - clock
        clock = time.perf_counter()
        actor, critic_state, metrics = update(actor, critic_state, learner, traj, config)
        update_s = time.perf_counter() - clock

    length = ids.shape[1]
    kept = num_kept_groups(groups, config.actor_rollout_ref.rollout.rollout_filter_ratio) * group_size
    train_tokens = kept * length
    train_flops = train_tokens * 4 * (forward_flops(model, model.vocab_size, length) + forward_flops(model, 1, length))
    peak = args.peak_tflops * 1e12
    print(f"rollout: {rows} rows × (prompt ≤ {prompt} + {new_tokens} new tokens): {generated} tokens "
          f"in {gen_s:.2f} s "
          f"(first call {compile_gen:.1f} s) → {generated / gen_s:,.0f} generated tokens/s, "
          f"MFU {100 * gen_flops / gen_s / peak:.2f} %")
    print(f"update: {kept} of {rows} trajectories kept × {length} tokens = {train_tokens} tokens in {update_s:.2f} s "
          f"(first call {compile_update:.1f} s) → {train_tokens / update_s:,.0f} training tokens/s, "
          f"MFU {100 * train_flops / update_s / peak:.2f} %")
    print(f"iteration (rollout + update): {gen_s + update_s:.2f} s; actor/grad_norm {metrics['actor/grad_norm']:.3g}; "
          f"peak {args.peak_tflops} TFLOP/s")
    if args.peer:
        peer_gen_s, peer_update_s, versions = torch_peer(model, tokens, mask, new_tokens, ids[:kept],
                                                         attention[:kept], loss_mask[:kept],
                                                         config.micro_batch_size_per_gpu)
        print(f"peer ({versions}): "
              f"generate {generated / peer_gen_s:,.0f} tokens/s in {peer_gen_s:.2f} s, update "
              f"{train_tokens / peer_update_s:,.0f} training tokens/s in {peer_update_s:.2f} s")
        print(f"ours / peer: generation {peer_gen_s / gen_s:.2f}x, update {peer_update_s / update_s:.2f}x "
              f"(throughput ratios; > 1 means ours is faster)")


if __name__ == "__main__":
    main()
