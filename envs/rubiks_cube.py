"""RAGEN-2's 2x2 Rubik's cube (``rubikscube``) as a gymnax environment (ragen2.md §7.5).

The sticker permutations are the reference's ``_move_*`` definitions copied exactly (whether they form a
physically consistent cube is not checked there, nor here). ``solution_depth`` is a host BFS validator.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from gymnax.environments import spaces

from envs.base import TextEnvironment, check_positive_int, step_info
from envs.text_pieces import PieceRenderer, build_piece_renderer

CUBE_INSTRUCTION = (
    "You are solving a 2x2 Rubik's Cube (Pocket Cube). The goal is to restore the cube so that each of the faces "
    "consists of a single, unique color.\n"
    "Available actions use standard Singmaster notation for face rotations: U, U', D, D', L, L', R, R', F, F', B, "
    "B'.\n"
    "- Faces: U (Up), D (Down), L (Left), R (Right), F (Front), B (Back).\n"
    "- Modifiers: A letter alone means 90\u00b0 clockwise (e.g., 'R'). A letter with prime (') means 90\u00b0 "
    "counter-clockwise (e.g., \"R'\").\n"
    'Respond with a sequence of actions separated by "||".\n'
    "Example: <answer>U</answer>\n"
)
ACTION_NAMES = ("U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'")
COLORS = "WOGRBY"
FACE_LABELS = ("Up (U):    ", "Left (L):  ", "Front (F): ", "Right (R): ", "Back (B):  ", "Down (D):  ")
# (face, [(new, old), ...]) of each base move: U, D, L, R, F, B (reference ids 1, 3, 5, 7, 9, 11).
BASE_MOVES = (
    (0, [(8, 12), (9, 13), (12, 16), (13, 17), (16, 4), (17, 5), (4, 8), (5, 9)]),
    (5, [(10, 6), (11, 7), (6, 18), (7, 19), (18, 14), (19, 15), (14, 10), (15, 11)]),
    (1, [(0, 19), (2, 17), (19, 20), (17, 22), (20, 8), (22, 10), (8, 0), (10, 2)]),
    (3, [(1, 9), (3, 11), (9, 21), (11, 23), (21, 18), (23, 16), (18, 1), (16, 3)]),
    (2, [(2, 7), (3, 5), (7, 21), (5, 20), (21, 12), (20, 14), (12, 2), (14, 3)]),
    (4, [(0, 13), (1, 15), (13, 22), (15, 23), (22, 6), (23, 4), (6, 0), (4, 1)]),
)


def _permutations() -> np.ndarray:
    """(12, 24) gather indices: ``new = old[perm[a]]`` for action ids 0-11 (reference ids 1-12)."""
    perms = []
    for face, cycle in BASE_MOVES:
        perm = np.arange(24)
        b = 4 * face
        for new, old in [(b, b + 2), (b + 2, b + 3), (b + 3, b + 1), (b + 1, b)] + cycle:
            perm[new] = old
        perms += [perm, perm[perm[perm]]]  # the prime applies the base move three times
    return np.stack(perms)


PERMUTATIONS = _permutations()
SOLVED = np.repeat(np.arange(6), 4)


@struct.dataclass
class CubeState:
    stickers: jax.Array  # (24,) int32 colours, face f holds stickers 4f..4f+3
    time: jax.Array


@struct.dataclass
class CubeParams:
    scramble_depth: int = struct.field(pytree_node=False, default=1)
    max_steps_in_episode: int = 20


def is_solved(stickers: jax.Array) -> jax.Array:
    faces = stickers.reshape(6, 4)
    return jnp.all(faces == faces[:, :1])


class RubiksCube(TextEnvironment):
    """The 2x2 cube; actions 0-11 are ``U, U', D, D', L, L', R, R', F, F', B, B'`` (reference ids 1-12).

    Reset scrambles the solved cube with ``scramble_depth`` uniform moves (which may cancel). Reward 1.0
    when a move solves the cube; the episode ends solved or after ``max_steps`` moves.
    """

    tag = "rubikscube"
    action_names = ACTION_NAMES
    env_instruction = CUBE_INSTRUCTION
    max_actions_per_traj = 20
    max_tokens = 96
    prompt_lists_actions = True

    def __init__(self, scramble_depth: int = 5, max_steps: int = 20):
        if isinstance(scramble_depth, bool) or int(scramble_depth) != scramble_depth or scramble_depth < 0:
            raise ValueError(f"scramble_depth must be a non-negative integer, got {scramble_depth!r}")
        self.params = CubeParams(int(scramble_depth), check_positive_int("max_steps", max_steps))
        self.permutations = jnp.asarray(PERMUTATIONS, jnp.int32)

    @property
    def default_params(self) -> CubeParams:
        return self.params

    def reset_env(self, key: jax.Array, params: CubeParams):
        moves = jax.random.randint(key, (params.scramble_depth,), 0, 12)
        stickers = jax.lax.fori_loop(0, params.scramble_depth, lambda i, s: s[self.permutations[moves[i]]],
                                     jnp.asarray(SOLVED, jnp.int32))
        state = CubeState(stickers, jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: CubeState, action, params: CubeParams):
        stickers = state.stickers[self.permutations[action]]
        solved = is_solved(stickers)
        new_state = CubeState(stickers, state.time + 1)
        done = solved | (new_state.time >= params.max_steps_in_episode)
        return self.get_obs(new_state), new_state, solved.astype(jnp.float32), done, step_info(solved, True, True)

    def get_obs(self, state: CubeState, params=None, key=None) -> jax.Array:
        """The 24 sticker colours and the step count (what ``render`` shows)."""
        return jnp.concatenate([state.stickers, state.time[None]]).astype(jnp.int32)

    def is_terminated(self, state: CubeState, params) -> jax.Array:
        return is_solved(state.stickers) | (state.time >= params.max_steps_in_episode)

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, 2**31 - 1, (25,), jnp.int32)

    def render_text(self, state: CubeState) -> str:
        """RAGEN's ``render()`` as the state manager calls it (``done=False``: actions always listed)."""
        return render_cube(jax.device_get(self.observe(state)), self.params.max_steps_in_episode)

    def reward_value(self, reward: float, params=None) -> float:
        return float(round(reward))

    def step_reward_values(self, params) -> tuple[float, ...]:
        return (0.0, 1.0)

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int, num_checks: int = 64) -> PieceRenderer:
        """Slots: the header with the step count, each face's 6**4 colourings, the action list."""
        max_steps = params.max_steps_in_episode
        header = [f"=== Rubik's Cube 2x2 State ===\nStep: {k}/{max_steps}\n\n" for k in range(max_steps + 1)]
        faces = []
        for face in range(6):
            end = "\n\n" if face == 5 else "\n"
            stickers = np.zeros(24, np.int32)
            variants = []
            for combo in itertools.product(range(6), repeat=4):
                stickers[4 * face:4 * face + 4] = combo
                variants.append(face_text(stickers, face) + end)
            faces.append(variants)
        tail = ["Available Actions:\n" + ", ".join(ACTION_NAMES) + "\n\nWhat is your next move?\n"]
        radix = 6 ** jnp.arange(3, -1, -1)

        def index_of(obs):
            colourings = (obs[:24].reshape(6, 4) * radix).sum(axis=1)
            return jnp.concatenate([jnp.minimum(obs[24:], max_steps), colourings, jnp.zeros(1, jnp.int32)])

        rng = np.random.default_rng(0)
        sample = np.concatenate([rng.integers(0, 6, (num_checks, 24)), rng.integers(0, max_steps + 1, (num_checks, 1))],
                                axis=1).astype(np.int32)
        return build_piece_renderer(self, tokenizer, [header, *faces, tail], index_of, sample,
                                    lambda obs: render_cube(obs, max_steps))


def face_text(stickers, face: int) -> str:
    c = [COLORS[int(x)] for x in stickers[4 * face:4 * face + 4]]
    return f"{FACE_LABELS[face]}[{c[0]}, {c[1]}]\n [{c[2]}, {c[3]}]"


def render_cube(obs, max_steps: int) -> str:
    """``render(done=False)`` from ``get_obs``'s vector."""
    lines = ["=== Rubik's Cube 2x2 State ===", f"Step: {int(obs[24])}/{max_steps}", ""]
    lines += [face_text(obs, f) for f in range(6)]
    lines += ["", "Available Actions:", ", ".join(ACTION_NAMES), "\nWhat is your next move?"]
    return "\n".join(lines)


def solution_depth(stickers, max_depth: int = 6) -> int | None:
    """Fewest moves that solve ``stickers`` (BFS over the 12 moves), or None beyond ``max_depth``."""
    frontier = np.asarray(stickers, np.int8)[None]
    seen = {frontier[0].tobytes()}
    for depth in range(max_depth + 1):
        faces = frontier.reshape(len(frontier), 6, 4)
        if np.any(np.all(faces == faces[:, :, :1], axis=(1, 2))):
            return depth
        children = frontier[:, PERMUTATIONS].reshape(-1, 24)
        keys = [c.tobytes() for c in children]
        fresh = [i for i, k in enumerate(keys) if k not in seen]
        seen.update(keys[i] for i in fresh)
        frontier = children[fresh]
    return None
