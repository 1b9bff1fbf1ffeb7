"""fastgrpo.packing: token-budget micro-batches for variable-length chains of thought.

`bins`: first-fit-decreasing bins and Karmarkar–Karp partitions (C++ in csrc/packing.cpp, with the
Python twins of `bins_py`); `plan`: the one micro-batch planner (local, or with the same count on
every data-parallel rank); `layout`: `PackedBatch`, the packed layouts (plain and shared-prefix)
and `unpack`. The names below are the package's public API (`fastgrpo.packing.PackedBatch`
is documented in the README).
"""
from fastgrpo.packing.bins import DEFAULT_ATTN_COEF, balance_partitions, build_cu_seqlens, build_position_ids, pack_sequences, partition_loads
from fastgrpo.packing.layout import PackedBatch, build_packed_batches, shares_prefix, unpack
from fastgrpo.packing.plan import plan_micro_batches

__all__ = ["DEFAULT_ATTN_COEF", "PackedBatch", "balance_partitions", "build_cu_seqlens", "build_packed_batches",
           "build_position_ids", "pack_sequences", "partition_loads", "plan_micro_batches", "shares_prefix", "unpack"]
