"""Multi-process GRPO training: DeepSpeed ZeRO (stage 0–3) or torch DDP as the data-parallel
backend, rollouts per rank on colocated engines, rollout batches balanced across ranks.

Follows verl's data-parallel GRPO layout: every rank generates rollouts for its own shard of
prompts (whole groups, so advantages stay local), then the rollout batch is rebalanced so that
every rank gets the same number of sequences and near-equal token workload (Karmarkar–Karp,
`fastgrpo.packing.bins.balance_partitions`, verl's `seqlen_balancing`). The update follows
DeepSpeed's documented engine loop (`engine(x)`, `engine.backward(loss)`, `engine.step()`) with
the gradient-accumulation boundary set by hand, because a token-budget packer yields a
different number of micro-batches each step.

Departures, and why:
- All ranks run the same number of micro-batches (the maximum over ranks): ZeRO-2/3 and DDP
  reduce gradients inside every backward, so a rank that skipped one would hang its peers. A
  rank short of sequences runs a zero-weighted one-token forward instead.
- Gradients are averaged over ranks by the backend, so a loss normalised by a global count
  (token-mean over all ranks' tokens) must be multiplied by the world size: `loss_scale`.
- On CPU, DeepSpeed's shared-memory all-reduce op is not built: it only serves
  `inference_all_reduce`, and building it costs ~50 s of C++ compilation on first use.
- The torch optimizer the caller built is used (no DeepSpeed fused Adam: nothing to compile).

- `step()` checks the global gradient for NaN / Inf before applying it and skips the update
  (no optimizer or scheduler step) when it is not finite, under every backend; DeepSpeed alone
  would apply it in bf16 without `check_grad_overflow`, and counts a skipped step as a step.

Launch: `torchrun --nproc_per_node N …` or `deepspeed --num_gpus N …`; gloo on CPU, nccl on GPU.
Data movement (shard, rebalance, all_gather, metric reduction) lives in
fastgrpo/trainer/collectives.py, the micro-batch planner in fastgrpo/packing/plan.py.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from fastgrpo import env

BACKENDS = ("none", "ddp", "deepspeed")


@dataclass(frozen=True)
class DistEnv:
    rank: int  # global rank of this process
    world_size: int  # number of training processes
    local_rank: int  # device index on this node


def launcher_env() -> DistEnv:
    """Rank, world size and local rank from the launcher (torchrun / deepspeed)."""
    return DistEnv(*env.launcher_ranks())


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def device_for(env: DistEnv) -> torch.device:
    """cuda:<local_rank> when CUDA is present, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_cpu_shm_op() -> None:
    # DeepSpeed's TorchBackend JIT-compiles a shared-memory all-reduce on CPU accelerators
    # (~50 s on 2 cores) that only `inference_all_reduce` uses; training collectives go
    # through torch.distributed. Marking the op incompatible makes DeepSpeed skip the build.
    import deepspeed

    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(backend: str = "deepspeed", timeout_s: float = 600.0) -> DistEnv:
    """Join the process group the launcher describes (no-op for a single process).

    `backend`: "deepspeed" (deepspeed.init_distributed) or "ddp"/"none" (torch). The
    communication backend is nccl when CUDA is present, gloo otherwise. Idempotent.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r}: expected a number of seconds > 0")
    env = launcher_env()
    if env.world_size < 1 or not (0 <= env.rank < env.world_size):
        raise ValueError(f"RANK={env.rank}, WORLD_SIZE={env.world_size}: expected 0 <= RANK < WORLD_SIZE")
    if env.world_size == 1 and backend != "deepspeed":
        return env
    comm = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(device_for(env))
    if backend == "deepspeed":
        import deepspeed

        _skip_cpu_shm_op()
        if not is_initialized() or not deepspeed.comm.is_initialized():
            kw = {}
            if env.world_size == 1 and not is_initialized():
                # not launched: a one-process group on a free local port, instead of
                # DeepSpeed's MPI discovery (which fails without mpirun)
                kw = dict(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                          auto_mpi_discovery=False)
            deepspeed.init_distributed(dist_backend=comm, timeout=timedelta(seconds=timeout_s), verbose=False, **kw)
    elif not is_initialized():
        dist.init_process_group(comm, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank(), world_size(), env.local_rank)


def shutdown() -> None:
    """Leave the process group (lets the launcher exit cleanly)."""
    if is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the training backend
# ---------------------------------------------------------------------------------------------

class _Call(torch.nn.Module):
    """The module DeepSpeed / DDP wrap: forward(fn, *args) runs fn(model, *args), so that any
    forward of the HF model (packed, fused lm_head, …) runs inside the engine's forward and its
    backward hooks (ZeRO's backward prologue, DDP's reducer) see it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def _loss_of(out) -> torch.Tensor:
    loss = out.loss if hasattr(out, "loss") else out
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError(f"loss_fn: expected a scalar tensor or an object with a scalar `.loss`, "
                         f"got {type(out).__name__}")
    return loss


def zero_weighted_loss(model: torch.nn.Module, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A loss of value 0 whose backward reaches every parameter, so that every rank's gradient
    reduction of this micro-batch still runs (peers wait on it) and adds exactly 0.

    `hidden`: the graph already built for a micro-batch that is being skipped (non-finite
    activations); the output head on one of its rows closes it. Not `p.reshape(-1)[0] * 0` (under
    ZeRO-3 a parameter is a 0-element partition outside its forward), nor a second forward (ZeRO-3
    counts per module the backwards owed to each forward; a dropped graph leaves this rank's count
    unpaid and its next reduce-scatter hangs). Without `hidden` (a rank short of sequences): a
    one-token forward. The value may be NaN (0 · NaN): such a step is discarded anyway."""
    if hidden is not None:
        return model.get_output_embeddings()(hidden[..., :1, :]).float().sum() * 0.0
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.get_input_embeddings().weight.device)
    return model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0


class DistributedBackend:
    """Data-parallel training of one HF causal LM with a caller-built torch optimizer.

    `backend`: "deepspeed" (ZeRO `zero_stage` 0–3, gradient clipping inside DeepSpeed),
    "ddp" (torch DistributedDataParallel) or "none" (one process, same API). The loop:

        backend = DistributedBackend(model, optimizer, scheduler, backend="deepspeed", zero_stage=2)
        plan = plan_micro_batches(lengths, max_tokens)               # same count on every rank
        outs = backend.accumulate(micro_batches, loss_fn)            # loss_fn(model, mb) -> LossOutput | tensor
        grad_norm = backend.step()                                   # clip, optimizer, scheduler, zero grads

    A loss normalised by a global count over all ranks (token-mean with `num_items` = all
    ranks' tokens) must be multiplied by `loss_scale` (= world size): the backends average
    gradients over ranks.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler=None, *,
                 backend: str = "deepspeed", zero_stage: int = 2, max_grad_norm: float = 1.0,
                 bf16: bool = False, timeout_s: float = 600.0):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r}: expected 0, 1, 2 or 3")
        if not (isinstance(max_grad_norm, (int, float)) and max_grad_norm >= 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r}: expected a number >= 0 (0 = no clipping)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.kind = backend
        self.zero_stage = zero_stage
        self.max_grad_norm = float(max_grad_norm)
        if backend == "none" and launcher_env().world_size > 1:
            raise ValueError(f"backend='none' under a {launcher_env().world_size}-process launch: the ranks "
                             "would train apart; expected 'ddp' or 'deepspeed'")
        self.env = init_distributed(backend, timeout_s)
        self.device = device_for(self.env)
        self.lr_scheduler = lr_scheduler
        self.optimizer = optimizer
        self._last_grad_norm: Optional[float] = None
        self.last_step_skipped = False  # whether the last step() skipped a non-finite gradient
        wrapper = _Call(model)
        if self.device.type != "cpu" or (backend == "deepspeed" and zero_stage == 3):
            # the oneDNN linears (fastgrpo.models.onednn) are a CPU float32 path: off CPU, and under
            # ZeRO-3 (partitioned weights, F.linear wrapped by DeepSpeed), they would only step
            # aside on every call and the packed row's ladder padding would be waste
            # the fused decoder layers (fastgrpo.models.fused_layer) likewise: ZeRO-3 gathers weights in
            # the submodules' forward hooks, which a fused layer would not call
            from fastgrpo.models.patch import unpatch_model

            unpatch_model(model)
        if backend == "deepspeed":
            import deepspeed

            config = {
                "train_micro_batch_size_per_gpu": 1,
                # accumulation is driven by hand (set_gradient_accumulation_boundary), and the
                # loss is already normalised, so DeepSpeed must not divide it again
                "gradient_accumulation_steps": 1,
                "gradient_clipping": self.max_grad_norm,
                "zero_optimization": {"stage": zero_stage},
                "bf16": {"enabled": bool(bf16)},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 2 ** 31 - 1,
                "wall_clock_breakdown": False,
            }
            self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                model=wrapper, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
        elif backend == "ddp" and self.env.world_size > 1:
            wrapper.to(self.device)
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.engine = torch.nn.parallel.DistributedDataParallel(wrapper, device_ids=ids)
        else:
            self.engine = wrapper.to(self.device)
        self._wrapper = wrapper

    # -- properties ------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The HF model (parameters partitioned under ZeRO-3: see `gathered_parameters`)."""
        return self._wrapper.model

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def loss_scale(self) -> float:
        return float(self.env.world_size)

    # -- forward / backward ----------------------------------------------------------------
    def forward(self, fn: Callable, *args, **kwargs):
        """fn(model, *args, **kwargs) run inside the engine's forward; returns fn's result."""
        return self.engine(fn, *args, **kwargs)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        """Backward of one micro-batch; `boundary` is True on the last one before `step()`."""
        if self.kind == "deepspeed":
            self.engine.set_gradient_accumulation_boundary(bool(boundary))
            self.engine.backward(loss, scale_wrt_gas=False)
        elif isinstance(self.engine, torch.nn.parallel.DistributedDataParallel) and not boundary:
            raise ValueError("boundary=False under DDP: use accumulate(), which runs the forward "
                             "inside no_sync() so that only the last micro-batch all-reduces")
        else:
            loss.backward()

    def accumulate(self, micro_batches: Sequence[Any], loss_fn: Callable) -> List[Any]:
        """Forward + backward of every micro-batch (None or an empty list → a zero-weighted
        dummy, see `plan_micro_batches`); gradients accumulate until `step()`. Returns
        loss_fn's outputs (None for dummies). loss_fn(model, mb) returns a LossOutput or a
        scalar loss tensor, already scaled as wanted (see `loss_scale`)."""
        outs: List[Any] = []
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            boundary = i == last
            empty = mb is None or (isinstance(mb, (list, tuple)) and len(mb) == 0)
            ddp = isinstance(self.engine, torch.nn.parallel.DistributedDataParallel)
            ctx = self.engine.no_sync() if (ddp and not boundary) else contextlib.nullcontext()
            with ctx:
                if empty:
                    loss, out = self.forward(zero_weighted_loss), None
                else:
                    out = self.forward(loss_fn, mb)
                    loss = _loss_of(out)
                if self.kind == "deepspeed":
                    self.backward(loss, boundary)
                else:
                    loss.backward()
            outs.append(out)
        return outs

    def local_grads_finite(self) -> bool:
        """Whether this rank's share of the accumulated gradients is finite; no collective (combine
        over ranks with a max-reduce). Under ZeRO 1–3 `p.grad` is None after the reduction: the
        reduced gradient partitions live in the ZeRO optimizer's `averaged_gradients`, and every
        element sits in exactly one rank's partition, so a NaN anywhere is seen by some rank."""
        grads: List[torch.Tensor] = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.kind == "deepspeed" and self.zero_stage > 0:
            for part in (getattr(self.engine.optimizer, "averaged_gradients", None) or {}).values():
                if isinstance(part, torch.Tensor):
                    grads.append(part)
                elif part is not None:
                    grads.extend(g for g in part if g is not None)
        # one foreach 2-norm per tensor (NaN / Inf propagate into it) instead of an isfinite pass
        # and a host sync per tensor: 45 vs 250 µs for the demo model's 26 gradients. A norm
        # that overflows only from finite values reads as non-finite, a step skipped anyway;
        # fp16 tensors (whose norm would overflow at 65504) are checked element-wise
        half = [g for g in grads if g.dtype == torch.float16]
        wide = [g for g in grads if g.dtype != torch.float16]
        if wide and not bool(torch.isfinite(torch.stack(torch._foreach_norm(wide, 2))).all()):
            return False
        return all(bool(torch.isfinite(g).all()) for g in half)

    def step(self, accept=None) -> float:
        """Gradient clipping, optimizer step, scheduler step, zero grads. Returns the global
        gradient norm before clipping. A non-finite gradient is never applied: the step is
        skipped instead (gradients discarded, no optimizer or scheduler step), the returned
        norm is non-finite and `last_step_skipped` is True. `accept(norm) -> bool` may refuse a
        finite norm the same way (the trainer's spike guard; DeepSpeed computes its norm inside
        its own step, so there it is not consulted). Collective."""
        self.last_step_skipped = False
        if self.kind == "deepspeed":
            bad = torch.tensor([0.0 if self.local_grads_finite() else 1.0])
            if self.world_size > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item():
                # bf16 ZeRO without check_grad_overflow would apply it (fp32 ZeRO skips it but
                # counts a step): skip here, before DeepSpeed sees it
                self.discard_gradients()
                norm = float("nan")
            else:
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
                norm = float(norm) if norm is not None else float("nan")
        else:
            params = [p for p in self.module.parameters() if p.grad is not None]
            clip = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
            # the norm is computed before scaling; a non-finite one scales nothing worth keeping
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip)) if params else 0.0
            refused = math.isfinite(norm) and accept is not None and not accept(norm)
            if math.isfinite(norm) and not refused:
                self.optimizer.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if refused:
                self.last_step_skipped = True
                self._last_grad_norm = norm
                return norm
        self.last_step_skipped = not math.isfinite(norm)
        self._last_grad_norm = norm
        return norm

    def discard_gradients(self) -> None:
        """Drop everything accumulated since the last `step()` without updating (a skipped
        step: non-finite loss). Zeroing `.grad` is not enough under ZeRO: stages 1–3 keep the
        reduced gradient partitions in their own buffers, which the next step would apply."""
        if self.kind != "deepspeed" or self.zero_stage == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return
        opt = self.engine.optimizer
        opt.zero_grad(set_to_none=True)
        # the same buffers ZeRO's own overflow path (a skipped fp16 step) clears
        for name in ("averaged_gradients", "all_grad_tensors"):
            buf = getattr(opt, name, None)
            if isinstance(buf, dict):
                for k in buf:
                    buf[k] = None
            elif isinstance(buf, list):
                buf.clear()
        if hasattr(opt, "_release_preflattened_grad_buffers"):
            opt._release_preflattened_grad_buffers()
        if self.zero_stage in (1, 2):  # stage 3's zero_grad resets its own counter
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            opt.micro_step_id = INITIAL_MICRO_STEP_ID

    # -- weights ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self):
        """Inside, every parameter of `module` holds its full value on every rank (ZeRO-3
        gathers its shards; other stages already hold full weights): weight sync to the
        colocated rollout engine and checkpoint saving read weights here."""
        if self.kind == "deepspeed" and self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield self.module
        else:
            yield self.module

    @contextlib.contextmanager
    def generation_weights(self):
        """Like `gathered_parameters`, for running the module's own forward outside the engine
        (the built-in rollout engine samples from it). Under ZeRO-3 the per-module hooks would
        re-partition every submodule after its forward, mid-generation, so they are removed
        inside and registered again on exit (TRL's `unwrap_model_for_generation` does the same)."""
        if not (self.kind == "deepspeed" and self.zero_stage == 3):
            yield self.module
            return
        offload = getattr(self.engine.optimizer, "parameter_offload", self.engine.optimizer)
        with self.gathered_parameters() as m:
            for p in offload.module.parameters():
                p.ds_active_sub_modules.clear()
            for h in offload.forward_hooks + offload.backward_hooks:
                h.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield m
            finally:
                # re-registering on the root also invalidates the prefetch trace
                offload._register_deepspeed_module(offload.module)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """CPU copy of the full model state dict (collective under ZeRO-3)."""
        with self.gathered_parameters() as m:
            return {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}

    def save_checkpoint(self, path: str, client_state: Optional[dict] = None) -> None:
        """Model + (sharded) optimizer + scheduler state; collective. DeepSpeed's own layout
        for "deepspeed", one torch file written by rank 0 otherwise."""
        if self.kind == "deepspeed":
            self.engine.save_checkpoint(path, tag="state", client_state=client_state or {})
            return
        if is_main():
            os.makedirs(path, exist_ok=True)
            state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                     "client_state": client_state or {}}
            tmp = os.path.join(path, "state.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(path, "state.pt"))  # atomic: a kill leaves the old file
        barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Inverse of `save_checkpoint`; returns the client state."""
        if self.kind == "deepspeed":
            _, client = self.engine.load_checkpoint(path, tag="state")
            return client or {}
        file = os.path.join(path, "state.pt")
        if not os.path.isfile(file):
            raise ValueError(f"path={path!r}: no state.pt (expected a directory written by save_checkpoint)")
        state = torch.load(file, map_location="cpu", weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["scheduler"])
        return state["client_state"]


def backend_from_config(model, optimizer, lr_scheduler, cfg, max_grad_norm: float = 1.0) -> DistributedBackend:
    """Build the backend from a `fastgrpo.config.DistributedConfig` (fields `backend`,
    `zero_stage`); "none" under a multi-process launch is promoted to "ddp" so that ranks
    never train apart."""
    kind = getattr(cfg, "backend", "none")
    if kind == "none" and launcher_env().world_size > 1:
        kind = "ddp"
    return DistributedBackend(model, optimizer, lr_scheduler, backend=kind,
                              zero_stage=int(getattr(cfg, "zero_stage", 0)), max_grad_norm=max_grad_norm)
