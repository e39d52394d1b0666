"""What RAGEN-2's collapse diagnostics cost, against the reference's layout and against a training pass.

RAGEN-2 scores the ``n · N`` (prompt, reasoning) sequences ``[x_j | z_i]`` column by column, each a full
teacher-forced forward (ragen2.md §3.6). Ours runs each prompt once into a KV cache shared by the ``n``
reasonings, all columns in one compiled program (``starpo_jax.collapse_scoring``). This script times, in one
process on the same weights:

- ours vs the reference's layout in PyTorch ``transformers`` (batched per column, ``no_grad``), for the two
  families at RAGEN-2's defaults (``num_samples`` 64; first-turn: one column per group, 8 groups; trajectory:
  64 columns);
- one policy-gradient pass (forward + backward of the token log-likelihood) over the rollout batch of
  ``env_groups × group_size`` trajectories, the bulk of a training step;

and prints the FLOPs of both families and of the gradient pass at Qwen2.5-3B size from XLA's cost analysis
of the lowered programs (nothing is allocated). Run: ``python -m bench.bench_collapse`` (``--help``).
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from bench import hygiene
from launch.model_shapes import DECODERS
from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.collapse_scoring import make_cross_log_probs
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.models.transformer import CausalLM
from starpo_jax.steps import model_token_log_probs


def family_inputs(rng, columns: int, rows: int, prompt: int, reasoning: int, vocab: int):
    prompts = rng.integers(1, vocab, (columns, prompt)).astype(np.int32)
    reasonings = rng.integers(1, vocab, (rows, reasoning)).astype(np.int32)
    return prompts, np.ones_like(prompts), reasonings, np.ones_like(reasonings)


def peer_cross(peer, prompts, reasonings) -> np.ndarray:
    """The reference's layout: per column, ``n`` full sequences ``[x_j | z_i]`` through the model."""
    out = np.zeros((len(reasonings), len(prompts)), np.float32)
    z = torch.from_numpy(reasonings).long()
    with torch.no_grad():
        for j, prompt in enumerate(prompts):
            ids = torch.cat([torch.from_numpy(prompt).long().expand(len(z), -1), z], dim=1)
            logits = peer(input_ids=ids).logits[:, prompt.shape[0] - 1:-1].float()
            out[:, j] = torch.log_softmax(logits, -1).gather(-1, z[..., None])[..., 0].sum(-1).numpy()
    return out


def flops(lowered) -> float:
    return float(lowered.cost_analysis()["flops"])


def flops_at_size(name: str, args) -> dict[str, float]:
    """XLA's FLOP count of one column (times N) and of the gradient pass, on abstract weights.

    XLA counts a loop body once, so the layers are unrolled, one column is lowered and multiplied by N, and the
    gradient pass takes its log-probs in one chunk.
    """
    config = TransformerConfig.from_hf(DECODERS[name], scan_layers=False)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    cross = make_cross_log_probs(graphdef, config)
    spec = jax.ShapeDtypeStruct

    def loss(params, ids, mask):
        return jnp.sum(model_token_log_probs(nnx.merge(graphdef, params), ids, mask, 1.0, chunk=ids.shape[1])[0])

    out = {}
    for family, columns, prompt in (("first-turn", args.groups, args.prompt), ("trajectory", args.rows, args.context)):
        ids = (spec((1, prompt), jnp.int32),) * 2 + (spec((args.rows, args.reasoning), jnp.int32),) * 2
        out[family] = flops(cross.lower(state, *ids)) * columns
        full = spec((args.rows, prompt + args.reasoning), jnp.int32)  # one column of the reference's layout
        out[f"{family}, reference layout"] = flops(jax.jit(loss).lower(state, full, full)) * columns

    batch = spec((args.batch, args.context + args.reasoning), jnp.int32)
    out["gradient pass"] = flops(jax.jit(jax.grad(loss)).lower(state, batch, batch))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="num_samples (reasonings per family)")
    parser.add_argument("--groups", type=int, default=8, help="first-turn columns (env_groups)")
    parser.add_argument("--prompt", type=int, default=256, help="first-turn prompt tokens")
    parser.add_argument("--context", type=int, default=512, help="trajectory-family prompt tokens (later turns)")
    parser.add_argument("--reasoning", type=int, default=64, help="reasoning tokens")
    parser.add_argument("--batch", type=int, default=128, help="rollout rows of a step (env_groups × group_size)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="Qwen2.5-3B", help="named shape for the FLOP count ('' skips it)")
    parser.add_argument("--flops-only", action="store_true", help="only the FLOP count (no timing)")
    hygiene.add_threads_argument(parser)
    args = parser.parse_args(argv)
    if args.flops_only:
        return print_flops(args)
    hygiene.start(args.threads)

    hf = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=1,
                                  max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    peer = transformers.Qwen2ForCausalLM(hf).eval()
    with tempfile.TemporaryDirectory() as folder:
        peer.save_pretrained(folder)
        mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        with jax.set_mesh(mesh):
            ours = load_pretrained(folder, mesh)
    graphdef, params = nnx.split(ours)
    cross = make_cross_log_probs(graphdef, ours.config)
    rng = np.random.default_rng(0)

    print(f"\n{'family':<11} {'n x N':>8} {'ours s':>8} {'peer s':>8} {'ours/peer':>9} {'max |diff|':>10}")
    for family, columns, prompt in (("first-turn", args.groups, args.prompt), ("trajectory", args.rows, args.context)):
        inputs = family_inputs(rng, columns, args.rows, prompt, args.reasoning, args.vocab)
        mine = np.asarray(cross(params, *inputs))  # compiles
        theirs = peer_cross(peer, inputs[0], inputs[2])
        ours_s, peer_s = hygiene.best_of([lambda: cross(params, *inputs).block_until_ready(),
                                          lambda: peer_cross(peer, inputs[0], inputs[2])], args.repeats)
        print(f"{family:<11} {args.rows:>3} x {columns:<3} {ours_s:8.3f} {peer_s:8.3f} {ours_s / peer_s:9.2f} "
              f"{np.abs(mine - theirs).max():10.2e}")

    ids = rng.integers(1, args.vocab, (args.batch, args.context + args.reasoning)).astype(np.int32)
    grad = jax.jit(jax.grad(lambda p, i, m: jnp.sum(model_token_log_probs(nnx.merge(graphdef, p), i, m, 1.0)[0])))
    jax.block_until_ready(grad(params, ids, np.ones_like(ids)))
    step_s, = hygiene.best_of([lambda: jax.block_until_ready(grad(params, ids, np.ones_like(ids)))], args.repeats)
    print(f"gradient pass over {args.batch} x {ids.shape[1]} tokens: {step_s:.3f} s (ours)")

    if args.size:
        print_flops(args)


def print_flops(args) -> None:
    counts = flops_at_size(args.size, args)
    print(f"\nFLOPs at {args.size}, {args.rows} reasonings of {args.reasoning} tokens, gradient pass over "
          f"{args.batch} x {args.context + args.reasoning} tokens (XLA cost analysis of the lowered programs):")
    for name, value in counts.items():
        print(f"  {name:<30} {value / 1e12:9.2f} TFLOP ({value / counts['gradient pass']:.1%} of the gradient pass)")


if __name__ == "__main__":
    main()
