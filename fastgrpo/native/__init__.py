"""fastgrpo.native: everything that loads or tunes native code.

`ext` loads the pybind11 module `fastgrpo._C` (csrc/*.cpp: packing, balancing); `jit` builds the
host-tuned sources of csrc/jit/ on first use (the decode step and sampler, the fused training
ops); `cpuinfo` reads the CPU's vendor and flags; `allocator` tunes glibc malloc for training;
`envinfo` is `fastgrpo env`'s report (versions, devices, whether the native code builds here).
"""
