"""Our decoder vs PyTorch ``transformers`` on the same config and weights, side by side.

Generation: our compiled sampler vs ``model.generate`` (greedy, fixed number of new
tokens), tokens/s at several batch sizes. Training: forward + backward of the mean
token log-likelihood, tokens/s. Prints ours/peer ratios (> 1 means we are faster)
and our compile times. Run: ``python -m bench.bench_llm`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from bench import hygiene
from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.steps import model_token_log_probs


def build_pair(args, folder):
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 4), max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    peer = transformers.Qwen2ForCausalLM(config).eval()
    peer.save_pretrained(folder)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        ours = load_pretrained(folder, mesh)
    return peer, ours


def bench_generation(peer, ours, args):
    graphdef, params = nnx.split(ours)
    sampler = make_sampler(graphdef, SamplerConfig(args.new_tokens, greedy=True))
    rng = np.random.default_rng(0)
    slots = args.cache_slots or args.prompt + args.new_tokens
    print(f"generation: prompt {args.prompt} tokens, {args.new_tokens} new tokens, greedy, our cache {slots} slots")
    print(f"{'batch':>6} {'ours tok/s':>12} {'torch tok/s':>12} {'ratio':>7} {'compile s':>10}")
    for batch in args.batches:
        tokens = rng.integers(1, args.vocab, (batch, args.prompt)).astype(np.int32)
        mask = np.ones_like(tokens)
        active = jnp.ones((batch,), bool)

        def run_ours():
            cache = init_cache(ours.config, batch, slots)
            jax.block_until_ready(sampler(params, tokens, mask, cache, jax.random.key(0), active).tokens)

        start = time.perf_counter()
        run_ours()
        compile_s = time.perf_counter() - start

        def run_peer():
            with torch.no_grad():
                peer.generate(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=0)

        run_peer()
        ours_s, peer_s = hygiene.best_of([run_ours, run_peer], args.repeats)
        n = batch * args.new_tokens
        print(f"{batch:>6} {n / ours_s:>12.1f} {n / peer_s:>12.1f} {peer_s / ours_s:>7.2f} {compile_s:>10.1f}")


def loss_function(graphdef):
    """Mean log-likelihood of tokens 1..L-1 through our trainer's log-prob path (``steps.model_token_log_probs``).

    The same quantity as the PyTorch side's log-softmax and gather, computed as our actor step computes it.
    """
    def loss_fn(params, tokens, mask):
        return jnp.mean(model_token_log_probs(nnx.merge(graphdef, params), tokens, mask, 1.0)[0])

    return loss_fn


def bench_training(peer, ours, args):
    batch, length = args.train_batch, args.train_length
    tokens = np.random.default_rng(1).integers(1, args.vocab, (batch, length)).astype(np.int32)
    mask = np.ones_like(tokens)
    graphdef, params = nnx.split(ours)
    step = jax.jit(jax.value_and_grad(loss_function(graphdef)))
    start = time.perf_counter()
    jax.block_until_ready(step(params, tokens, mask))
    compile_s = time.perf_counter() - start

    ids = torch.tensor(tokens, dtype=torch.long)

    def run_peer():
        peer.zero_grad()
        logits = peer(input_ids=ids, attention_mask=torch.tensor(mask)).logits
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        torch.gather(log_probs, -1, ids[:, 1:, None]).mean().backward()

    run_peer()
    ours_s, peer_s = hygiene.best_of([lambda: jax.block_until_ready(step(params, tokens, mask)), run_peer],
                                     args.repeats)
    n = batch * length
    print(f"forward+backward: batch {batch} x {length} tokens")
    print(f"  ours {n / ours_s:.1f} tok/s, torch {n / peer_s:.1f} tok/s, ratio {peer_s / ours_s:.2f}, "
          f"compile {compile_s:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--cache-slots", type=int, default=0,
                        help="our KV cache's slots (default prompt + new tokens); a multi-turn rollout's cache has "
                             "max_model_len + response slots whatever the turn's length, HF's grows with the text")
    parser.add_argument("--no-training", action="store_true", help="generation only")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    print(f"devices: {jax.devices()}, threads: {args.threads} each (XLA, torch {torch.get_num_threads()})")
    print(f"model: qwen2 hidden {args.hidden}, layers {args.layers}, heads {args.heads}, vocab {args.vocab}, fp32")
    with tempfile.TemporaryDirectory() as folder:
        peer, ours = build_pair(args, folder)
    bench_generation(peer, ours, args)
    if not args.no_training:
        bench_training(peer, ours, args)


if __name__ == "__main__":
    main()
