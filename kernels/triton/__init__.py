"""fastgrpo.kernels.triton: the Triton backend of the loss contract (CUDA, or TRITON_INTERPRET=1).

`_common` holds the shared `@triton.jit` helpers and autotune configs; `logprobs` the no-grad
log-prob / entropy kernel; `grpo_loss` the loss forward and the in-place logits backward.
"""
