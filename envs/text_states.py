"""Token tables of a gridless environment's states (Bandit's rules), looked up by observation.

The fused rollout driver renders states on device through ``TextEnvironment.state_renderer``;
a grid environment returns an ``envs.tokens.GridRenderer``, the default is the ``StateTexts`` of
its distinct reset states. A text state ends in a newline that some pre-tokenizers join to the
next ``"\\n"`` and others do not, so the driver folds the ``You have N actions…`` piece that
follows into each entry (``StateTexts.fold_budget`` → ``TextStates``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NUM_TABLE_RESETS = 64  # resets enumerating a gridless environment's states (Bandit: two arm orders)


class Piece(NamedTuple):
    """Variants of one text piece: token ids ``[n, W]`` (0-padded) and ``lengths[n]``."""

    ids: jax.Array
    lengths: jax.Array


def make_piece(rows: Sequence[Sequence[int]]) -> Piece:
    """A ``Piece`` of token-id rows of any lengths."""
    ids = np.zeros((len(rows), max(1, max(len(r) for r in rows))), np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    return Piece(jnp.asarray(ids), jnp.asarray([len(r) for r in rows], jnp.int32))


def reset_states(env: Any, params: Any, count: int) -> tuple[list[Any], np.ndarray]:
    """``count`` reset states (unbatched, host) and their observations, seeds ``0 … count − 1``."""
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(jnp.arange(count))
    obs, batch = jax.jit(jax.vmap(env.reset_env, (0, None)))(keys, params)
    return [jax.tree.map(lambda x: x[i], batch) for i in range(count)], np.asarray(obs)


class TextStates(NamedTuple):
    """Entry ``state * (max_actions_per_traj + 1) + N``: state ``state``'s text, newline and budget piece N."""

    obs: jax.Array  # [n, *obs_shape]
    text: Piece

    def tokens(self, obs: jax.Array, actions_left: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Ids and length of the state whose observation is ``obs``, with its ``actions_left`` piece."""
        flat = self.obs.reshape(self.obs.shape[0], -1)
        row = jnp.argmax(jnp.all(flat == obs.reshape(1, -1), axis=1))
        row = row * (self.text.ids.shape[0] // flat.shape[0]) + actions_left
        return self.text.ids[row], self.text.lengths[row]


class StateTexts(NamedTuple):
    """Every distinct reset state of a gridless environment, before the budget pieces are known.

    ``TextEnvironment.state_renderer``'s default; the fused driver calls ``fold_budget`` with the
    text that follows a state for each number of actions left.
    """

    obs: np.ndarray  # [n, *obs_shape]
    texts: tuple[str, ...]

    def fold_budget(self, tokenizer: Any, budget_texts: Sequence[str]) -> TextStates:
        """The ``TextStates`` of these states, each encoded with ``"\n"`` and each of ``budget_texts``."""
        encoded = tokenizer([text + "\n" + after for text in self.texts for after in budget_texts],
                            add_special_tokens=False)["input_ids"]
        return TextStates(jnp.asarray(self.obs), make_piece([list(r) for r in encoded]))


def distinct_reset_states(env: Any, params: Any) -> StateTexts:
    """The distinct states of ``NUM_TABLE_RESETS`` resets (by text), in order of first appearance.

    A step always ends Bandit, so no later state is ever shown; an environment whose steps show
    new states needs a renderer of its own.
    """
    states, obs = reset_states(env, params, NUM_TABLE_RESETS)
    texts = [env.render_text(s) for s in states]
    rows = sorted({text: i for i, text in reversed(list(enumerate(texts)))}.values())
    return StateTexts(obs[rows], tuple(texts[i] for i in rows))
