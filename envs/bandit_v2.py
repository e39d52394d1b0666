"""RAGEN-2's Bandit (ragen2.md §7.7): each reset draws one of the split's (low, high) arm-name pairs.

Differences from the reference, both from its per-instance seed offset (``seed + internal_seed``, a class-level
counter): there, the environments of one group get different pairs and orders; here the key fixes them, so a
group shares its pair (what the reference's comment says was intended). The action vocabulary is every name
of the split: pulling an arm that is not one of this episode's pair is an invalid action (reward 0, episode over),
where RAGEN drops the unknown name with the format penalty. Fused rollouts are refused (24 or 16 distinct
prompts are not enumerated on device): use the host driver.
"""

import jax
import jax.numpy as jnp
from flax import struct

from envs.bandit import Bandit, BanditParams, BanditState
from envs.base import step_info

ARM_NAMES = {
    "train": (("Teacher", "Trader"), ("Nurse", "StartupFounder"), ("Librarian", "Investor"),
              ("Accountant", "StockBroker"), ("Engineer", "RealEstateAgent"), ("Pharmacist", "Musician"),
              ("Clerk", "Freelancer"), ("Technician", "Youtuber"), ("Planner", "Artist"), ("Postman", "Pilot"),
              ("Banker", "VentureCapitalist"), ("Gardener", "Cryptominer")),
    "test": (("Receptionist", "Explorer"), ("Archivist", "Filmmaker"), ("Bookkeeper", "Consultant"),
             ("SocialWorker", "Photographer"), ("Mechanic", "GameDesigner"), ("Secretary", "Entrepreneur"),
             ("Cashier", "DataScientist"), ("CivilServant", "StartupAccelerator")),
}


@struct.dataclass
class BanditV2State(BanditState):
    pair: jax.Array = 0  # index into the split's pairs


class BanditV2(Bandit):
    """Two arms named by a pair drawn at reset; action ``2 i`` pulls pair i's low arm, ``2 i + 1`` its high arm."""

    def __init__(self, split: str = "train", lo_arm_score: float = 0.1, hi_arm_loscore: float = 0.0,
                 hi_arm_hiscore: float = 1.0, hi_arm_hiscore_prob: float = 0.25):
        if split not in ARM_NAMES:
            raise ValueError(f"split must be one of {tuple(ARM_NAMES)}, got {split!r}")
        super().__init__(*ARM_NAMES[split][0], lo_arm_score, hi_arm_loscore, hi_arm_hiscore, hi_arm_hiscore_prob)
        self.split = split
        self.action_names = tuple(name for pair in ARM_NAMES[split] for name in pair)

    def reset_env(self, key: jax.Array, params: BanditParams):
        k_pair, k_order = jax.random.split(key)
        pair = jnp.floor(jax.random.uniform(k_pair) * len(ARM_NAMES[self.split])).astype(jnp.int32)
        state = BanditV2State(jax.random.uniform(k_order) >= 0.5, jnp.int32(-1), jnp.float32(0.0), jnp.int32(0), pair)
        return self.get_obs(state), state

    def step_env(self, key: jax.Array, state: BanditV2State, action, params: BanditParams):
        mine = action // 2 == state.pair
        high = mine & (action % 2 == 1)
        hi_reward = jnp.where(jax.random.uniform(key) < params.hi_arm_hiscore_prob, params.hi_arm_hiscore,
                              params.hi_arm_loscore)
        reward = jnp.where(high, hi_reward, jnp.where(mine, params.lo_arm_score, 0.0)).astype(jnp.float32)
        new = state.replace(last_action=jnp.asarray(action, jnp.int32), last_reward=reward, time=state.time + 1)
        return self.get_obs(new), new, reward, jnp.bool_(True), step_info(high, mine, mine)

    def get_obs(self, state: BanditV2State, params=None, key=None) -> jax.Array:
        """Action ids in the order the prompt lists the arms."""
        low = 2 * state.pair
        return jnp.where(state.swapped, jnp.stack([low + 1, low]), jnp.stack([low, low + 1])).astype(jnp.int32)

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int):
        raise ValueError(f"{self.tag}: RAGEN-2's Bandit draws its arm names per episode and is host-only; "
                         "set agent_proxy.rollout_driver=host")
