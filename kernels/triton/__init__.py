"""fastgrpo.kernels.triton: the Triton backend of the loss contract (CUDA, or TRITON_INTERPRET=1).

`_common` holds the shared `@triton.jit` helpers; `_tune` the per-device config tables, the
tuner (scratch-slice timing, on-disk cache, compile-failure fallback); `logprobs` the no-grad
log-prob / entropy kernel; `grpo_loss` the loss forward and the in-place logits backward;
`fused_linear` the single-kernel lm_head + log-probs (impl="cce").
"""
