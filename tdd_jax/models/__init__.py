"""Stable Diffusion (1.5 / XL) components in Flax NNX with diffusers/transformers numerics.

- ``unet``: ``UNet2DConditionModel(cfg, rngs)``; call ``unet(sample_nhwc, timesteps, context, added_cond_kwargs,
  lora_scale=1.0)``.
- ``vae``: ``AutoencoderKL`` (``encode`` -> posterior, ``decode``, ``scale_latents``).
- ``clip``: ``CLIPTextModel`` (with or without projection) and ``tokenize``.
- ``diffusers_io``: ``load_pipeline`` / ``load_unet`` / ... from diffusers folders onto shardings.
- ``lora`` / ``lora_io``: adapters on the UNet, kohya / PEFT import, diffusers-loadable export.
"""
