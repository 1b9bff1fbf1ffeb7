"""fastgrpo.sync: trainer → rollout-engine weight sync.

- bucket.py: plan / pack / receive contiguous buckets with (name, dtype, shape, offset) metadata
- sender.py: the trainer side (double-buffered), and the per-parameter baseline
- shm.py, cuda_ipc.py: the buffers' transports (CPU shared memory, CUDA IPC handles)
- worker_ext.py: the vLLM worker extension that loads buckets with `reload_weights`
- direct.py: in-place copy for the built-in torch engine
"""
from fastgrpo.sync.bucket import DEFAULT_BUCKET_BYTES, BucketReceiver, TensorSlice, pack_bucket, plan_buckets
from fastgrpo.sync.sender import BucketedSender, SyncStats, sync_per_parameter

__all__ = ["DEFAULT_BUCKET_BYTES", "BucketReceiver", "BucketedSender", "SyncStats", "TensorSlice", "pack_bucket",
           "plan_buckets", "sync_per_parameter"]
