"""Fused multi-turn rollout (starpo.md §3): a whole episode of JAX environments in one compiled program.

Each turn (the first, then the rest inside one ``lax.while_loop``, each at its own segment width) builds
every active row's next segment from pre-tokenized pieces, decodes it with ``starpo_jax.sampler`` (the KV cache kept across
turns), parses the generated ids on device (the environment's ``response_parser``), steps the
vmapped environments with RAGEN's rules (``starpo_jax.env_manager.run_turn``) and keeps
the counters the host driver keeps in its slots, RAGEN-2's episode metrics (``slot_metrics``) included.

The trajectory is the exact id sequence the decoder saw (``train_on_sampled_ids``,
starpo.md §22.10): generated ids are never re-tokenized. The fed text is cut into pieces at
the variable parts — the chat up to the first state, the turn-end and user header up to
``Reward:\\n{total}\\n``, ``\\nTurn k:\\nState:\\n``, the state, ``You have N actions left…``
through the forced ``<think>`` — and each piece is tokenized on its own. The host driver
tokenizes each fed text whole, so ``build_env_tables`` checks, for every reward text, turn
number and budget and for sampled states, that the pieces concatenate to the whole-text
encoding, and raises naming the tokenizer when a merge crosses a boundary. With the same
seeds and greedy decoding both drivers then give identical trajectories.
"""

from __future__ import annotations

import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from envs.text_states import make_piece
from runtime.mesh import batch_sharding
from starpo_jax.env_manager import Slot, info_metrics
from starpo_jax.fused_tables import EnvTables, build_env_tables
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import KVCache, cache_shardings, init_cache
from starpo_jax.rollout import RolloutSettings, pack_sequences, training_tail
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.trajectory import Trajectory, Turn

__all__ = ["EnvTables", "FusedEpisode", "FusedOutput", "FusedRollout", "build_env_tables", "fused_rollout",
           "make_fused_rollout"]

class FusedRollout(NamedTuple):
    """The compiled program and what it was built with (``make_fused_rollout``)."""

    run: Callable
    tables: tuple[EnvTables, ...]
    block_sizes: tuple[int, ...]
    settings: RolloutSettings
    mesh: Mesh | None
    chunks: int = 1


class FusedEpisode(NamedTuple):
    """What the compiled program returns, per row: the id sequence and the slot counters."""

    ids: jax.Array  # [B, S] fed and sampled ids, left aligned
    length: jax.Array
    log_probs: jax.Array  # [B, S] the sampler's log-prob of each sampled id, NaN for fed ids
    step_rewards: jax.Array  # [B, max_actions_per_traj] float32, in execution order
    step_raw_rewards: jax.Array  # [B, max_actions_per_traj] float32 info["raw_reward"], NaN where none
    turn_scores: jax.Array  # [B, max_turn] float32, each played turn's summed reward (0 after the last)
    turn_actions: jax.Array  # [B, max_turn] int32, the actions each turn executed
    num_actions: jax.Array
    num_penalties: jax.Array
    num_turns: jax.Array
    num_valid: jax.Array  # turns whose last executed action was valid
    num_effective: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    step_scores: jax.Array  # [B, max_actions_per_traj] float32 info["score"], NaN where none
    overflow: jax.Array  # some turn's prompt exceeded max_model_len
    env_metrics: tuple = ()  # per block: TextEnvironment.episode_metrics of the final states


def _concat(pieces: Sequence[tuple[jax.Array, jax.Array]]) -> tuple[jax.Array, jax.Array]:
    """Left-aligned concatenation of per-row pieces ``(ids[B, W_i], lengths[B])``."""
    width = sum(ids.shape[1] for ids, _ in pieces)
    batch = pieces[0][0].shape[0]
    out, total = jnp.zeros((batch, width + 1), jnp.int32), jnp.zeros(batch, jnp.int32)
    rows = jnp.arange(batch)[:, None]
    for ids, lengths in pieces:
        column = jnp.arange(ids.shape[1])[None]
        out = out.at[rows, jnp.where(column < lengths[:, None], total[:, None] + column, width)].set(ids)
        total = total + lengths
    return out[:, :width], total


def _append(buffer: jax.Array, length: jax.Array, ids: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes the first ``count`` of each row's ``ids`` after ``length`` (dropped past the end)."""
    column = jnp.arange(ids.shape[1])[None]
    slots = jnp.where(column < count[:, None], length[:, None] + column, buffer.shape[1])
    return buffer.at[jnp.arange(buffer.shape[0])[:, None], slots].set(ids, mode="drop"), length + count


def _right_align(ids: jax.Array, count: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """Left-aligned rows → left-padded ``(tokens, mask)`` for the model."""
    width = ids.shape[1]
    source = jnp.arange(width)[None] - (width - count[:, None])
    mask = source >= 0
    return jnp.where(mask, jnp.take_along_axis(ids, jnp.maximum(source, 0), axis=1), pad_id), mask.astype(jnp.int32)


def _where(mask: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b), new, old)


class _Block(NamedTuple):
    """Per-tag loop state."""

    keys: jax.Array
    env_state: Any
    reward_total: jax.Array


class _Loop(NamedTuple):
    turn: jax.Array
    cache: KVCache
    ids: jax.Array
    length: jax.Array
    ended: jax.Array
    warned: jax.Array  # the row's last turn executed no valid action (RAGEN-2's warning, prompt_layout=v2)
    blocks: tuple
    episode: FusedEpisode


def _play_actions(tables: EnvTables, block: _Block, action_ids, num_actions, step_rewards, raw_rewards, scores,
                  active):
    """``run_turn``'s execution: the parsed valid actions in order, stopping at ``done``."""
    env, rewards = tables.env, tables.rewards
    step = jax.vmap(env.step_env, (0, 0, 0, None))
    rows = jnp.arange(action_ids.shape[0])

    def one(carry, action):
        (state, count, total, running, done, success, valid, effective, stepped, reward_buffer, raw_buffer,
         score_buffer) = carry
        run = running & (action >= 0)
        keys = jax.vmap(jax.random.fold_in)(block.keys, count + 1)
        _, new_state, reward, new_done, info = step(keys, state, jnp.maximum(action, 0), tables.params)
        value = jnp.argmin(jnp.abs(reward[:, None] - rewards.values[None]), axis=1)
        column = jnp.where(run, count, reward_buffer.shape[1])
        reward_buffer = reward_buffer.at[rows, column].set(reward, mode="drop")
        raw = info.get("raw_reward", jnp.full_like(reward, jnp.nan))
        raw_buffer = raw_buffer.at[rows, column].set(raw.astype(jnp.float32), mode="drop")
        if "score" in info:
            score_buffer = score_buffer.at[rows, column].set(info["score"].astype(jnp.float32), mode="drop")
        return (_where(run, new_state, state), count + run, jnp.where(run, rewards.next_total[total, value], total),
                running & ~(run & new_done), jnp.where(run, new_done, done),
                jnp.where(run, info["success"], success), jnp.where(run, info["action_is_valid"], valid),
                jnp.where(run, info["action_is_effective"], effective), stepped | run, reward_buffer, raw_buffer,
                score_buffer), None

    false = jnp.zeros_like(active)
    init = (block.env_state, num_actions, jnp.zeros_like(num_actions), active, false, false, false, false, false,
            step_rewards, raw_rewards, scores)
    return jax.lax.scan(one, init, action_ids.T)[0]


def make_fused_rollout(graphdef: nnx.GraphDef, model_config: TransformerConfig, sampler_config: SamplerConfig,
                       tables: Sequence[EnvTables], block_sizes: Sequence[int], tokenizer: Any,
                       settings: RolloutSettings, mesh: Mesh | None = None, chunks: int = 1) -> FusedRollout:
    """Compiles ``run(params, seeds, key, rows) -> FusedEpisode`` for rows grouped by tag.

    With ``chunks`` > 1 the program plays ``1 / chunks`` of every block's rows, ``rows`` their indices in the
    whole batch (whose draws each row takes: ``starpo_jax.sampler.choose``); ``fused_rollout`` runs the
    chunks concurrently, which keeps more cores busy than one program of small operations does on a CPU.

    Rows ``sum(block_sizes[:b])`` onwards (``block_sizes[b]`` of them) play ``tables[b]``'s
    environment; row i's environment is reset with ``seeds[i]`` exactly as ``GymnaxHostEnv``
    does, and turn t decodes with ``fold_in(key, t)``, as ``host_rollout``. The KV cache
    (``max_model_len + max_new_tokens`` slots, on ``cache_shardings`` with ``mesh``) lives
    only inside the program. The per-turn scores are always returned; ``settings.use_turn_scores``
    only decides whether ``fused_rollout`` places them, so it does not change the program.
    """
    if not settings.train_on_sampled_ids:
        raise ValueError("the fused rollout cannot re-render RAGEN's cleaned chat on device (re-tokenising a cleaned "
                         "response needs the tokenizer's merges): set train_on_sampled_ids=True to generate from and "
                         "train on the sampled ids, or agent_proxy.rollout_driver=host for RAGEN's cleaned turns")
    if len(tables) != len(block_sizes) or not tables:
        raise ValueError(f"one block size per environment table, got {len(block_sizes)} for {len(tables)}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos not in sampler_config.stop_ids:
        raise ValueError(f"SamplerConfig.stop_ids must contain the EOS id {eos}, got {sampler_config.stop_ids}")
    if chunks < 1 or any(n % chunks for n in block_sizes):
        raise ValueError(f"rollout_chunks={chunks} must be >= 1 and divide every block's rows {list(block_sizes)}")
    total_rows = sum(block_sizes)
    sample = make_sampler(graphdef, sampler_config, mesh=mesh, total_rows=total_rows if chunks > 1 else None)
    starts = np.cumsum([0, *(n // chunks for n in block_sizes)])
    tail = make_piece([tokenizer.encode(training_tail(tokenizer, _finished_slot(), settings), add_special_tokens=False)])
    max_budget = max(t.env.max_actions_per_traj for t in tables)

    def segment(t: EnvTables, block: _Block, first: bool, turn, ended, warned, num_actions, active):
        """The fed ids of one turn: the chat up to the first state (``first``), else the turn-end through the
        next state; each compiled at its own width, so later turns do not pad to the system prompt's length."""
        rows = ended.shape[0]
        obs = jax.vmap(t.env.get_obs)(block.env_state)
        left = t.env.max_actions_per_traj - num_actions + warned * (t.env.max_actions_per_traj + 1)
        state = jax.vmap(t.states.tokens)(obs, left)
        after = (t.after.ids[left], t.after.lengths[left])
        fixed = lambda p, i: (jnp.broadcast_to(p.ids[i], (rows, p.ids.shape[1])), jnp.full(rows, p.lengths[i]))
        if first:
            ids, count = _concat([fixed(t.prompt_head, 0), state, after])
        else:
            turn_number = jnp.minimum(turn + 1, t.turn.ids.shape[0] - 1)
            eos_ids = (jnp.full((rows, 1), eos, jnp.int32), jnp.where(ended, 0, 1).astype(jnp.int32))
            reward = (t.rewards.text.ids[block.reward_total], t.rewards.text.lengths[block.reward_total])
            ids, count = _concat([eos_ids, fixed(t.head, 0), reward, fixed(t.turn, turn_number), state, after])
        return ids, jnp.where(active, count, 0)

    def turn_body(params, key, rows, first: bool, s: _Loop) -> _Loop:
        e = s.episode
        active = ~e.terminated
        pieces = [segment(t, b, first, s.turn, s.ended[lo:hi], s.warned[lo:hi], e.num_actions[lo:hi], active[lo:hi])
                  for t, b, lo, hi in zip(tables, s.blocks, starts[:-1], starts[1:])]
        width = max(ids.shape[1] for ids, _ in pieces)
        seg = jnp.concatenate([jnp.pad(ids, ((0, 0), (0, width - ids.shape[1]))) for ids, _ in pieces])
        seg_length = jnp.concatenate([n for _, n in pieces])
        overflow = e.overflow | jnp.any(active & (s.length + seg_length > settings.max_model_len))
        tokens, mask = _right_align(seg, seg_length, pad)
        out = sample(params, tokens, mask, s.cache, jax.random.fold_in(key, s.turn), active, rows, empty=first)
        ids, length = _append(s.ids, s.length, seg, seg_length)
        log_probs, _ = _append(e.log_probs, length, out.log_probs, out.lengths)
        ids, length = _append(ids, length, out.tokens, out.lengths)
        last = jnp.take_along_axis(out.tokens, jnp.maximum(out.lengths - 1, 0)[:, None], axis=1)[:, 0]
        ended = jnp.where(active, last == eos, s.ended)
        blocks, columns, warned = [], [], []
        for t, b, lo, hi in zip(tables, s.blocks, starts[:-1], starts[1:]):
            left = t.env.max_actions_per_traj - e.num_actions[lo:hi]
            parsed = jax.vmap(t.parser.parse)(out.tokens[lo:hi], out.lengths[lo:hi], left)
            on = active[lo:hi]
            if parsed.context is not None:  # e.g. Sudoku's echo of the turn's last action
                b = b._replace(env_state=_where(on, jax.vmap(t.env.begin_turn)(b.env_state, parsed.context),
                                                b.env_state))
            warned.append(jnp.where(on, parsed.num_valid == 0, s.warned[lo:hi]))
            (state, count, total, _, done, success, valid, effective, stepped, rewards, raw_rewards,
             scores) = _play_actions(t, b, parsed.action_ids, e.num_actions[lo:hi], e.step_rewards[lo:hi],
                                     e.step_raw_rewards[lo:hi], e.step_scores[lo:hi], on)
            blocks.append(_Block(b.keys, state, jnp.where(on, total, b.reward_total)))
            done_now = on & done
            out_of_budget = on & ~done & (count >= t.env.max_actions_per_traj)
            turn_scores = e.turn_scores[lo:hi].at[:, s.turn].set(jnp.where(on, t.rewards.totals[total], 0.0))
            turn_actions = e.turn_actions[lo:hi].at[:, s.turn].set(jnp.where(on, count - e.num_actions[lo:hi], 0))
            columns.append(dict(
                step_rewards=rewards, step_raw_rewards=raw_rewards, step_scores=scores, turn_scores=turn_scores,
                turn_actions=turn_actions, num_actions=count,
                num_penalties=e.num_penalties[lo:hi] + (on & parsed.format_penalty),
                num_turns=e.num_turns[lo:hi] + on, num_valid=e.num_valid[lo:hi] + (on & stepped & valid),
                num_effective=e.num_effective[lo:hi] + (on & stepped & effective),
                terminated=e.terminated[lo:hi] | done_now | out_of_budget,
                truncated=jnp.where(done_now, ~success, e.truncated[lo:hi] | out_of_budget)))
        episode = e._replace(overflow=overflow, log_probs=log_probs, **{k: jnp.concatenate([c[k] for c in columns])
                                                   for k in columns[0]})
        return _Loop(s.turn + 1, out.cache, ids, length, ended, jnp.concatenate(warned), tuple(blocks), episode)

    def rollout(params, seeds, key, rows=None) -> FusedEpisode:
        batch = seeds.shape[0]
        cache = init_cache(model_config, batch, settings.max_model_len + sampler_config.max_new_tokens)
        if mesh is not None:
            cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
        blocks = []
        for t, lo, hi in zip(tables, starts[:-1], starts[1:]):
            keys = jax.vmap(jax.random.key)(seeds[lo:hi])
            _, state = jax.vmap(t.env.reset_env, (0, None))(jax.vmap(jax.random.fold_in, (0, None))(keys, 0), t.params)
            blocks.append(_Block(keys, state, jnp.zeros(hi - lo, jnp.int32)))
        zeros, false = jnp.zeros(batch, jnp.int32), jnp.zeros(batch, bool)
        episode = FusedEpisode(jnp.zeros((batch, cache.max_length), jnp.int32), zeros,
                               jnp.full((batch, cache.max_length), jnp.nan, jnp.float32),
                               jnp.zeros((batch, max_budget), jnp.float32),
                               jnp.full((batch, max_budget), jnp.nan, jnp.float32),
                               jnp.zeros((batch, settings.max_turn), jnp.float32),
                               jnp.zeros((batch, settings.max_turn), jnp.int32), zeros, zeros, zeros, zeros, zeros,
                               false, false, jnp.full((batch, max_budget), jnp.nan, jnp.float32), jnp.bool_(False))
        state = _Loop(jnp.int32(0), cache, episode.ids, zeros, jnp.ones(batch, bool), false, tuple(blocks), episode)
        state = turn_body(params, key, rows, True, state)
        final = jax.lax.while_loop(lambda s: (s.turn < settings.max_turn) & jnp.any(~s.episode.terminated),
                                   lambda s: turn_body(params, key, rows, False, s), state)
        ids, length = _append(final.ids, final.length, jnp.full((batch, 1), eos, jnp.int32),
                              jnp.where(final.ended, 0, 1).astype(jnp.int32))
        ids, length = _append(ids, length, jnp.broadcast_to(tail.ids, (batch, tail.ids.shape[1])),
                              jnp.full(batch, tail.lengths[0]))
        env_metrics = tuple(jax.vmap(t.env.episode_metrics)(b.env_state) for t, b in zip(tables, final.blocks))
        return final.episode._replace(ids=ids, length=length, env_metrics=env_metrics)

    return FusedRollout(jax.jit(rollout), tuple(tables), tuple(block_sizes), settings, mesh, chunks)


def _finished_slot() -> Slot:
    """A slot whose last response is answered: its training text ends the trajectory."""
    answered = Turn("s", 1, "<think></think><answer></answer>", "Reward:\n0\n")
    return Slot(types.SimpleNamespace(max_tokens=100), 0, 0, "p", [answered, Turn("s", 0)])


def _turn_infos(raw: list[float], scores: np.ndarray, turn_actions: np.ndarray) -> list[dict[str, float]]:
    """The numeric info keys ``run_turn`` keeps per turn (``raw_reward`` summed, the last ``score``) from the
    per-action buffers, for ``info_metrics``; the V1 flags come from the episode's counters."""
    infos, start = [], 0
    for count in map(int, turn_actions):
        end, info = start + count, {}
        if count and not np.isnan(raw[end - 1]):
            info["raw_reward"] = float(sum(raw[start:end]))
        if count and not np.isnan(scores[end - 1]):
            info["score"] = float(scores[end - 1])
        infos.append(info)
        start = end
    return infos


def _chunk_rows(block_sizes: Sequence[int], chunks: int) -> list[np.ndarray]:
    """Each chunk's rows in the whole batch: the chunk-th ``1 / chunks`` of every block, block by block."""
    starts = np.cumsum([0, *block_sizes])
    return [np.concatenate([start + np.arange(c * n // chunks, (c + 1) * n // chunks)
                            for start, n in zip(starts, block_sizes)]) for c in range(chunks)]


def _play(program: FusedRollout, params: Any, seeds: np.ndarray, key: jax.Array) -> FusedEpisode:
    """The compiled episode on the host; with ``program.chunks`` > 1 the chunks run concurrently (JAX releases
    the GIL while a program runs) and their rows are put back in the batch's order."""
    def run(rows: np.ndarray | None) -> FusedEpisode:
        inputs = [jnp.asarray(seeds if rows is None else seeds[rows], jnp.int32)]
        if rows is not None:
            inputs.append(jnp.asarray(rows, jnp.int32))
        if program.mesh is not None:
            inputs = [jax.device_put(x, batch_sharding(program.mesh, 1)) for x in inputs]
        return jax.device_get(program.run(params, inputs[0], key, *inputs[1:]))

    if program.chunks == 1:
        return run(None)
    rows = _chunk_rows(program.block_sizes, program.chunks)
    with ThreadPoolExecutor(program.chunks) as pool:
        parts = list(pool.map(run, rows))
    order = np.argsort(np.concatenate(rows))
    per_row = [p._replace(overflow=None, env_metrics=None) for p in parts]
    merged = jax.tree.map(lambda *xs: np.concatenate(xs)[order], *per_row)
    env_metrics = tuple(jax.tree.map(lambda *xs: np.concatenate(xs), *[p.env_metrics[b] for p in parts])
                        for b in range(len(program.block_sizes)))
    return merged._replace(overflow=any(bool(p.overflow) for p in parts), env_metrics=env_metrics)


class FusedOutput(NamedTuple):
    """The trajectories and RAGEN's per-trajectory env metrics (``env_manager.slot_metrics``), per row."""

    trajectory: Trajectory
    metrics: list[dict[str, float]]


def fused_rollout(program: FusedRollout, params: Any, tokenizer: Any, seeds: Sequence[int], group_ids: Sequence[int],
                  key: jax.Array) -> FusedOutput:
    """Runs the compiled episode and lays it out as ``host_rollout`` does (bucketed left padding, masks).

    Row i plays block b's environment (tag id b) from ``seeds[i]``; scores and penalties are
    summed as the host slots sum them (Python numbers, from the integer 0 and 0.0). With
    ``use_turn_scores`` each played turn's score goes on its turn end (``pack_sequences``).
    """
    settings, tables = program.settings, program.tables
    tag_ids = np.repeat(np.arange(len(program.block_sizes)), program.block_sizes)
    if len(seeds) != len(tag_ids) or len(group_ids) != len(tag_ids):
        raise ValueError(f"seeds and group_ids need {len(tag_ids)} entries (block sizes {program.block_sizes}), "
                         f"got {len(seeds)} and {len(group_ids)}")
    episode = _play(program, params, np.asarray(seeds), key)
    if episode.overflow:
        raise ValueError(f"a prompt exceeds max_model_len={settings.max_model_len} tokens")
    sequences = [row[:n] for row, n in zip(episode.ids, episode.length)]
    sampled = [row[:n] for row, n in zip(episode.log_probs, episode.length)]
    scores, penalties, metrics = [], [], []
    starts = np.cumsum([0, *program.block_sizes])
    for i, tag in enumerate(tag_ids):
        t, executed = tables[tag], range(int(episode.num_actions[i]))
        rewards = [t.env.reward_value(float(episode.step_rewards[i, k]), t.params) for k in executed]
        scores.append(float(sum(rewards)))
        penalty = 0.0
        for _ in range(int(episode.num_penalties[i])):  # run_turn's float sum, rounding included
            penalty += settings.format_penalty
        penalties.append(penalty)
        turns = max(int(episode.num_turns[i]), 1)
        raw = [float(episode.step_raw_rewards[i, k]) for k in executed]
        row = {"success": float(episode.terminated[i] and not episode.truncated[i]),
               "num_actions": float(episode.num_actions[i]),
               **info_metrics(_turn_infos(raw, episode.step_scores[i], episode.turn_actions[i, :turns])),
               "action_is_effective": int(episode.num_effective[i]) / turns,
               "action_is_valid": int(episode.num_valid[i]) / turns,
               "episodic_return": float(sum(r if r == r else v for r, v in zip(raw, rewards)))}  # NaN: no raw_reward
        row.update({name: float(v[i - starts[tag]]) for name, v in episode.env_metrics[tag].items()})
        metrics.append(row)
    turn_scores = ([row[:n] for row, n in zip(episode.turn_scores, episode.num_turns)]
                   if settings.use_turn_scores else None)
    return FusedOutput(pack_sequences(tokenizer, sequences, settings, scores=scores, penalty=penalties,
                                      group_ids=group_ids, tag_ids=tag_ids, turn_scores=turn_scores,
                                      rollout_log_probs=sampled), metrics)
