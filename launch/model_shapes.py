"""Named model shapes for ``launch.compile``: the ``config.json`` fields of public checkpoints.

Only shapes are needed to compile a program; the values are those of each model's Hugging Face
``config.json`` (decoders) or diffusers ``unet/config.json`` (UNets), restricted to the fields our
config readers use. Checked (December 2026) against copies of the published files:

- Qwen2.5-0.5B / 1.5B: ``huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B}/blob/main/config.json``, as vendored in
  Lightning-AI/litgpt ``litgpt/config.py`` and transcribed in public Qwen2Config listings;
- Qwen2.5-3B / 7B / 14B, Qwen3-8B, Llama-3.1-8B: the config.json files collected in
  citsjtu2020/LLM-Prof ``sglang/Model_Config.md``;
- SDXL: ``stabilityai/stable-diffusion-xl-base-1.0/unet/config.json`` (quoted in google/maxdiffusion's
  SDXL UNet test); SD1.5: ``runwayml/stable-diffusion-v1-5/unet/config.json`` (diffusers' defaults
  plus ``cross_attention_dim=768``, ``attention_head_dim=8``, ``sample_size=64``).

The base (not -Instruct) checkpoints' values are given; they differ only in ``max_position_embeddings``,
which changes no shape. ``tests/test_launch_model_shapes.py`` pins every shape's parameter count,
built by our model code on abstract shapes, to the published total.
"""

from __future__ import annotations

_QWEN2 = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=32768)

DECODERS: dict[str, dict] = {
    "Qwen2.5-0.5B": dict(_QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "Qwen2.5-3B": dict(_QWEN2, vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       max_position_embeddings=131072),
    "Qwen2.5-14B": dict(_QWEN2, vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-5,
                        max_position_embeddings=131072),
    "Qwen3-8B": dict(model_type="qwen3", hidden_act="silu", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    "Llama-3.1-8B": dict(model_type="llama", hidden_act="silu", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
}

UNETS: dict[str, dict] = {
    "SD1.5": dict(in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280, 1280],
                  down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                  up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, layers_per_block=2,
                  attention_head_dim=8, cross_attention_dim=768, norm_num_groups=32, sample_size=64),
    "SDXL": dict(in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280],
                 down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], layers_per_block=2,
                 transformer_layers_per_block=[1, 2, 10], attention_head_dim=[5, 10, 20], cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, norm_num_groups=32, sample_size=128),
}
# Text-conditioning shapes of each UNet's encoders: (tokens, context width, pooled width or None).
UNET_TEXT = {"SD1.5": (77, 768, None), "SDXL": (77, 2048, 1280)}
# The Stable Diffusion noise schedule (scheduler/scheduler_config.json of both pipelines).
SD_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    prediction_type="epsilon")
