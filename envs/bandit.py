"""RAGEN's two-armed bandit: the agent guesses the better arm from the arms' names alone."""

import jax
import jax.numpy as jnp
from flax import struct
from gymnax.environments import spaces

from envs.base import TextEnvironment, check_finite_float, step_info

INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher "
    "rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a} </answer> "
    "or <answer> {name_b} </answer>.\n"
)
@struct.dataclass
class BanditState:
    swapped: jax.Array  # True: the high arm is listed first (RAGEN's arm 1)
    last_action: jax.Array
    last_reward: jax.Array
    time: jax.Array


@struct.dataclass
class BanditParams:
    """RAGEN's defaults; the paper's text gives ``lo_arm_score=0.15``."""

    lo_arm_score: float = 0.1
    hi_arm_loscore: float = 0.0
    hi_arm_hiscore: float = 1.0
    hi_arm_hiscore_prob: float = 0.25
    max_steps_in_episode: int = 1


class Bandit(TextEnvironment):
    """Two arms; action 0 pulls the low arm (deterministic reward), action 1 the high arm (risky).

    The order in which the prompt lists the arms is drawn at reset (RAGEN's ``_randomize_arms``);
    one pull ends the episode and ``success`` means the high arm was chosen.

    Args:
        lo_arm_name, hi_arm_name: the arms' names (the actions).
        lo_arm_score: the low arm's deterministic reward.
        hi_arm_loscore, hi_arm_hiscore, hi_arm_hiscore_prob: the high arm pays ``hi_arm_hiscore``
            with probability ``hi_arm_hiscore_prob``, else ``hi_arm_loscore``.
    """

    tag = "Bandit"
    env_instruction = ""
    max_actions_per_traj = 1

    def __init__(self, lo_arm_name: str = "Phoenix", hi_arm_name: str = "Dragon", lo_arm_score: float = 0.1,
                 hi_arm_loscore: float = 0.0, hi_arm_hiscore: float = 1.0, hi_arm_hiscore_prob: float = 0.25):
        for field, name in (("lo_arm_name", lo_arm_name), ("hi_arm_name", hi_arm_name)):
            if not isinstance(name, str) or not name.strip() or "||" in name:
                raise ValueError(f"{field} must be a non-empty name without '||', got {name!r}")
        if lo_arm_name.lower() == hi_arm_name.lower():
            raise ValueError(f"lo_arm_name and hi_arm_name must differ, got {lo_arm_name!r} twice")
        if not 0.0 <= check_finite_float("hi_arm_hiscore_prob", hi_arm_hiscore_prob) <= 1.0:
            raise ValueError(f"hi_arm_hiscore_prob must be a probability in [0, 1], got {hi_arm_hiscore_prob!r}")
        self.action_names = (lo_arm_name, hi_arm_name)
        self.params = BanditParams(check_finite_float("lo_arm_score", lo_arm_score),
                                   check_finite_float("hi_arm_loscore", hi_arm_loscore),
                                   check_finite_float("hi_arm_hiscore", hi_arm_hiscore), float(hi_arm_hiscore_prob))

    @property
    def default_params(self) -> BanditParams:
        """RAGEN's ``BanditEnvConfig`` scores as this environment's ``env_config`` sets them."""
        return self.params

    def reset_env(self, key: jax.Array, params: BanditParams):
        swapped = jax.random.uniform(key) >= 0.5
        state = BanditState(swapped, jnp.int32(-1), jnp.float32(0.0), jnp.int32(0))
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: BanditState, action, params: BanditParams):
        high = action == 1
        hi_reward = jnp.where(jax.random.uniform(key) < params.hi_arm_hiscore_prob, params.hi_arm_hiscore, params.hi_arm_loscore)
        reward = jnp.where(high, hi_reward, params.lo_arm_score).astype(jnp.float32)
        new_state = BanditState(state.swapped, jnp.asarray(action, jnp.int32), reward, state.time + 1)
        return self.get_obs(new_state), new_state, reward, jnp.bool_(True), step_info(high, True, True)

    def get_obs(self, state: BanditState, params=None, key=None) -> jax.Array:
        """Action ids in the order the prompt lists the arms."""
        return jnp.where(state.swapped, jnp.array([1, 0]), jnp.array([0, 1])).astype(jnp.int32)

    def is_terminated(self, state: BanditState, params) -> jax.Array:
        return state.time > 0

    def observation_space(self, params=None) -> spaces.Box:
        return spaces.Box(0, 1, (2,), jnp.int32)

    def render_text(self, state: BanditState, params: BanditParams | None = None) -> str:
        """The game rules before the pull, ``"{arm}: {reward} points"`` after it."""
        if int(state.time) == 0:
            name_a, name_b = (self.action_names[int(i)] for i in jax.device_get(self.observe(state)))
            return INIT_PROMPT.format(name_a=name_a, name_b=name_b)
        reward = self.reward_value(float(state.last_reward), params)
        return f"{self.action_names[int(state.last_action)]}: {reward} points"

    def step_reward_values(self, params: BanditParams) -> tuple[float, ...]:
        return (params.lo_arm_score, params.hi_arm_loscore, params.hi_arm_hiscore)

    def reward_value(self, reward: float, params: BanditParams | None = None) -> float:
        """The configured Python float nearest to the float32 reward (``0.1``, ``1.0``, ``0.0``)."""
        params = params or self.default_params
        scores = (params.lo_arm_score, params.hi_arm_loscore, params.hi_arm_hiscore)
        return float(min(scores, key=lambda score: abs(score - reward)))
