"""fastgrpo.kernels: fused GRPO loss kernels (Triton), the CPU streaming path, and the oracle."""
