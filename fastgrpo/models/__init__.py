"""fastgrpo.models: everything that runs or changes a Hugging Face model.

`packed` runs packed (varlen, shared-prefix) forwards; `patch` is the one place that swaps
fastgrpo's fast paths into a model and back (`onednn` linears, `fused_layer` decoder layers).
"""
