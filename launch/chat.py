"""Talk to a policy with this project's JAX sampler: one episode of an environment, or a free chat.

    python -m launch.chat --model runs/starpo/rl_coordfrozenlake/hf_model --env CoordFrozenLake \
        $(python -c "from launch.demo_starpo import LAKE_KEYS; print(*LAKE_KEYS)")
    python -m launch.chat --model runs/starpo/rl_bandit/hf_model --env Bandit --seed 7
    python -m launch.chat --model runs/starpo/rl_bandit/hf_model --prompt "Which arm do you pull?"
    python -m launch.chat --model runs/starpo/rl_bandit/hf_model           # free chat, one line per turn

``--model`` is a Hugging Face folder (or a hub id already in the local cache) whose tokenizer has a chat
template, e.g. the ``hf_model/`` a StarPO run exports. With ``--env`` the episode is played as validation
plays it (host rollout driver, the preset's ``agent_proxy`` limits and ``val_kwargs`` sampling, seed
``--seed``), then every message is printed with the result. Without it, each ``--prompt`` (or each line
typed; an empty line ends) is answered with the chat so far as context. RAGEN ``key=value`` overrides apply,
e.g. ``custom_envs.FrozenLake.env_config.is_slippery=true`` or ``actor_rollout_ref.rollout.val_kwargs.do_sample=
false`` (greedy). No PyTorch, nothing downloaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.config import EnvConfigs, EnvGroupsConfig, StarPOConfig
from starpo_jax.env_manager import Slot
from starpo_jax.models.hf_io import load_pretrained, resolve_folder
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.presets import PRESETS, load_config
from starpo_jax.rollout import host_rollout, slot_chat
from starpo_jax.rollout_drivers import make_slots, rollout_settings
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.tokenizer import chat_prompt, encode_left_padded, load_tokenizer, require_chat_template


class Policy:
    """The model of ``config.model_path`` on one device with its tokenizer and a compiled sampler."""

    def __init__(self, config: StarPOConfig):
        rollout = config.actor_rollout_ref.rollout
        self.tokenizer = require_chat_template(load_tokenizer(config.model_path))
        self.mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
        with jax.set_mesh(self.mesh):
            model = load_pretrained(config.model_path, self.mesh)
        self.model_config = model.config
        graphdef, self.params = nnx.split(model)
        self.sampler_config = SamplerConfig(
            rollout.response_length, rollout.val_kwargs.temperature, rollout.top_p, max(rollout.top_k, 0),
            greedy=not rollout.val_kwargs.do_sample, stop_ids=(self.tokenizer.eos_token_id,),
            pad_id=self.tokenizer.pad_token_id)
        self.sample = make_sampler(graphdef, self.sampler_config)


def play_episode(policy: Policy, config: StarPOConfig, tag: str, seed: int, key: jax.Array) -> Slot:
    """One episode of ``tag`` from ``seed``, played by the host rollout driver; returns its slot."""
    settings = rollout_settings(config)
    slots = make_slots(EnvGroupsConfig(1, 1, EnvConfigs((tag,), (1,))), seed, config.custom_envs)
    cache = init_cache(policy.model_config, 1, settings.max_model_len + policy.sampler_config.max_new_tokens)
    with jax.set_mesh(policy.mesh):
        host_rollout(policy.sample, policy.params, policy.tokenizer, slots, cache, key, settings)
    return slots[0]


def episode_messages(slot: Slot, config: StarPOConfig) -> list[dict[str, str]]:
    """The played episode as RAGEN's chat: system, the instruction and states, responses, rewards."""
    return slot_chat(slot, rollout_settings(config))


def reply(policy: Policy, messages: Sequence[dict[str, str]], key: jax.Array) -> str:
    """The policy's next assistant message after ``messages`` (the whole chat is prefilled afresh)."""
    tokens, mask = encode_left_padded(policy.tokenizer, [chat_prompt(policy.tokenizer, messages)])
    cache = init_cache(policy.model_config, 1, tokens.shape[1] + policy.sampler_config.max_new_tokens)
    with jax.set_mesh(policy.mesh):
        out = policy.sample(policy.params, tokens, mask, cache, key, jnp.ones((1,), bool))
    ids, length = jax.device_get((out.tokens[0], out.lengths[0]))
    return policy.tokenizer.decode(ids[:length], skip_special_tokens=True)


def print_message(message: dict[str, str]) -> None:
    print(f"[{message['role']}]\n{message['content'].strip()}\n", flush=True)


def read_line() -> str:
    """A line typed at the ``>`` prompt; end of input reads as the empty line that ends the chat."""
    try:
        return input("> ")
    except EOFError:
        return ""


def free_chat(policy: Policy, prompts: Sequence[str] | None, key: jax.Array,
              read: Callable[[], str] = read_line) -> list[dict[str, Any]]:
    """Answers ``prompts`` in turn (or lines from ``read`` until an empty one); returns the chat."""
    messages: list[dict[str, Any]] = []
    turns = iter(prompts) if prompts else iter(read, "")
    for turn, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        if prompts:
            print_message(messages[-1])
        messages.append({"role": "assistant", "content": reply(policy, messages, jax.random.fold_in(key, turn))})
        print_message(messages[-1])
    return messages


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face folder or hub-cache id with a chat template")
    parser.add_argument("--env", help="a custom_envs tag to play one episode of (e.g. Bandit, FrozenLake)")
    parser.add_argument("--seed", type=int, default=123, help="the episode's initial state (RAGEN's val seeds)")
    parser.add_argument("--prompt", action="append", help="a free-chat user message (repeat for several turns)")
    parser.add_argument("--preset", default="starpo-s-grpo", choices=sorted(PRESETS), metavar="NAME",
                        help="a starpo_jax.presets name: turn limits, response length and sampling")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.env and args.prompt:
        parser.error("--env plays an episode; --prompt is for free chat: give one of them")
    resolve_folder(args.model)  # a missing folder is reported before anything else
    config = load_config(args.preset, [f"model_path={args.model}", *overrides])
    if args.env and args.env not in config.custom_envs:
        parser.error(f"--env: unknown environment tag {args.env!r}; choose from {sorted(config.custom_envs)}")
    policy = Policy(config)
    key = jax.random.key(args.seed)
    if not args.env:
        return free_chat(policy, args.prompt, key)
    slot = play_episode(policy, config, args.env, args.seed, key)
    messages = episode_messages(slot, config)
    for message in messages:
        print_message(message)
    print(f"{args.env} seed {args.seed}: {'success' if slot.success else 'no success'}, reward {slot.score:g}, "
          f"{slot.num_actions} action(s) in {len(slot.turn_rewards)} turn(s)")
    return messages


if __name__ == "__main__":
    main()
