"""Continuous diffusion policies under the Miles API (ARCHITECTURE.md, "Continuous policies").

  policy   prompt-conditioned eps-network (LoRA-targetable Linear names)
  sde      DDPM/DDIM schedule, THE step function ``ddim_step`` (samples or scores), SDE/ODE samplers
  task     a verifiable prompt-conditioned constraint task, its reward, noisy demonstrations
  train    denoising SFT, rollouts with group advantages, ADPO on per-step Gaussian log-probs
  storage  Arrow/Parquet layout for recorded per-step latents
"""
