"""Decoder LMs (Qwen2/2.5, Qwen3, Llama 3.x) in Flax NNX with a critic head, LoRA and HF checkpoint I/O."""

from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.hf_io import load_pretrained, merge_lora, save_peft_adapter, save_pretrained
from starpo_jax.models.kv_cache import KVCache, cache_shardings, init_cache
from starpo_jax.models.lora import LoRAConfig, adapters_off
from starpo_jax.models.transformer import CausalLM, Critic

__all__ = ["CausalLM", "Critic", "KVCache", "LoRAConfig", "TransformerConfig", "adapters_off", "cache_shardings",
           "init_cache", "load_pretrained", "merge_lora", "save_peft_adapter", "save_pretrained"]
