"""Built-in rollout engine: batched sampling with a KV cache on the trainer's own HF model.

The default when vLLM is not installed, and the reference the vLLM engine is tested against.
Prompts are left-padded into one batch; each step feeds one token per row with explicit
position ids (so padding does not shift positions) and the HF cache. Sampling follows vLLM's
order — logits in float32 → / temperature → top-k → top-p → sample — and reports the log-prob of
the sampled token under that processed distribution (see base.py for what top-k / top-p do to
it). Each completion with a seed gets its own `torch.Generator`, so a completion does not depend
on the rest of the batch (decoders.py: per-row uniforms for inverse-CDF draws, one call per row).

Tuned for tiny models on CPU, where framework overhead, not FLOPs, sets the pace (see
benchmarks/bench_rollout.py): the prefill runs once per distinct prompt and its cache is expanded
to the G completions of the group (vLLM's prefix cache does the same job); finished rows leave the
batch at once (compaction, like a continuous-batching scheduler that admits nothing new); the
bookkeeping is one vectorised op per step instead of a Python loop over rows; tiny decode steps
run on one intra-op thread (see `_threads`). With decoder="auto" on CPU float32 the native module
(csrc/jit/decode_step.cpp) also prefills Qwen2 / Qwen3 / Llama prompts (`LeanStepper.native_prefill`) and
runs each step's sampling, log-prob, stop check and bookkeeping writes in one call (`sample_step`); at 8
prompts × 8 samples × 32 tokens on the demo model that took a trainer rollout from ~11.6 to
~7 ms on one thread (the rest is the decode steps' GEMMs).

A row whose logits hold a NaN or +inf, or are all -inf, has no distribution to sample: both
samplers raise ValueError naming the row and step (vLLM would emit some token).

Departures from vLLM: no continuous batching (no new requests join a running batch), no prefix
cache across calls; stop strings are matched on the decoded completion. Weight updates are
direct (sync/direct.py): by default the engine *shares* the trainer's module, so after an
optimizer step there is nothing to copy.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import torch

from fastgrpo.rollout.decoders import HFStepper, LeanStepper, pick, uniforms
from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig, token_versions

# Decode steps below this many FLOPs (2 · parameters · batch) run on one thread (see _threads).
_SMALL_STEP_FLOP = 1e9


def _compact_at(rows: int, small_step: bool = True) -> int:
    """Finished rows that trigger a compaction of a batch of `rows`. Small decode steps (< 1
    GFLOP, see `_threads`): a quarter of the batch (at least one). There a compaction, which
    copies the whole KV cache, costs ~150 µs at batch 64 on the demo model (one thread), while a
    finished row riding along costs ~2.8 µs a decode step (310 vs 219 µs for 64 vs 32 rows):
    finished rows stay until they are a quarter of the batch (at most a third extra rows per
    step, one compaction per quarter instead of one per finishing step). Larger steps, where a
    row's matmuls outweigh a cache copy, compact as soon as one row finishes."""
    return max(1, rows // 4) if small_step else 1


_DECODERS = ("auto", "lean", "hf")


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float32 logits / temperature, with top-k / top-p truncated entries set to -inf (vLLM's
    `apply_top_k_top_p` semantics: top-p keeps the smallest set of mass >= p, at least 1)."""
    z = logits.float() if temperature == 1.0 else logits.float() / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass strictly ahead of each token
        drop = before >= top_p
        drop[..., 0] = False
        z = z.scatter(-1, idx, sorted_z.masked_fill(drop, float("-inf")))
    return z


class TorchEngine(RolloutEngine):
    """Rollouts on an HF causal LM in this process.

    max_batch_size: completions decoded together; num_threads: intra-op threads while decoding
    (None: 1 for small steps, see `_threads`; the process's setting is restored afterwards);
    decoder: "auto" runs Qwen2 / Qwen3 / Llama decode steps (full attention; sliding-window layers
    keep the HF module) through `LeanStepper` (decoders.py; its native step, csrc/jit/decode_step.cpp, for
    float32 on CPU where it builds) and any other model through its HF module; "lean" is
    LeanStepper's Python step only; "hf" always uses the HF module (the reference path).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, copy_model: bool = False,
                 max_batch_size: int = 64, pad_token_id: Optional[int] = None, num_threads: Optional[int] = None,
                 decoder: str = "auto"):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: expected an integer >= 1")
        if num_threads is not None and not (isinstance(num_threads, int) and num_threads >= 1):
            raise ValueError(f"num_threads={num_threads!r}: expected an integer >= 1 or None (auto)")
        if decoder not in _DECODERS:
            raise ValueError(f"decoder={decoder!r}: expected one of {list(_DECODERS)} ('auto': the lean "
                             "Qwen2/Qwen3/Llama decoder where supported, native where it builds, else the HF "
                             "module; 'lean': its Python step; 'hf': always the HF module)")
        self.num_threads = num_threads
        self.decoder = decoder
        self.model = copy.deepcopy(model) if copy_model else model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        gen = getattr(model, "generation_config", None)
        eos = tokenizer.eos_token_id if tokenizer is not None else getattr(gen, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer is not None else getattr(gen, "pad_token_id", None)
        self.pad_id = int(pad_token_id if pad_token_id is not None else 0)
        # weights that change in the middle of a call (an async rollout worker with
        # rollout.inflight=keep | abort): None, or an object with `mode` ("keep" | "abort"),
        # `version` (the weights' version now) and `poll()` -> the new version once it has
        # loaded newer weights into `self.model` in place, else None. Polled between decode steps.
        self.inflight = None

    def update_weights(self, model_or_named):
        from fastgrpo.sync.direct import copy_weights

        named = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) else model_or_named
        return copy_weights(self.model, named)

    def close(self) -> None:
        self.model = None

    def _n_params(self) -> int:
        # parameter counts do not change under a rollout engine (weights are copied in place)
        if getattr(self, "_params_of", None) is not self.model:
            self._params_of, self._params = self.model, sum(p.numel() for p in self.model.parameters())
        return self._params

    def _threads(self, batch: int) -> int:
        """Intra-op threads for decoding a batch: the constructor's `num_threads`, else 1 when a
        decode step is small (< 1 GFLOP: every size up to hidden 256, 4 layers, batch 128).
        Measured on the shared 2-core CPU: at hidden 64 / batch 64 a step's matmuls are
        [64, 64] x [64, 128], ~12 µs on one thread; with a second OpenMP thread on a busy machine
        they took 0.05-4 ms (the thread team spins on an occupied core), a 1.4-3 s rollout instead
        of 20 ms. At hidden 256 / 4 layers / batch 128 (0.56 GFLOP a step) two threads won when
        the machine was idle (252 vs 417 ms) and lost 20x when it was not (10.3 s vs 0.48 s)."""
        if self.num_threads is not None:
            return self.num_threads
        return 1 if 2 * self._n_params() * batch < _SMALL_STEP_FLOP else torch.get_num_threads()

    def _sample(self, prompt_ids, sampling: SamplingConfig, max_new_tokens: int, seeds) -> List[Completion]:
        out: List[Completion] = []
        for i in range(0, len(prompt_ids), self.max_batch_size):
            out.extend(self._sample_batch(prompt_ids[i:i + self.max_batch_size], sampling, max_new_tokens,
                                          seeds[i:i + self.max_batch_size]))
            if self.progress is not None:
                self.progress(len(out) - i)
        return out

    def _sample_batch(self, prompt_ids, sampling: SamplingConfig, max_new_tokens: int, seeds) -> List[Completion]:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        threads = torch.get_num_threads()
        want = self._threads(len(prompt_ids)) if device.type == "cpu" else threads
        # model.eval() (a walk over every submodule, ~0.1 ms a rollout on the demo model) only
        # where the HF module runs (_prefill); the native prefill and lean steps read weights only
        try:
            if want != threads:
                torch.set_num_threads(want)
            with torch.inference_mode():
                return self._loop(model, device, prompt_ids, sampling, max_new_tokens, seeds)
        finally:
            if want != threads:
                torch.set_num_threads(threads)
            if model.training != was_training:
                model.train(was_training)

    def _prefill(self, model, device, prompt_ids, max_new_tokens: int):
        """(stepper, last logits [B, V], next positions [B]) after one prefill over the *distinct*
        prompts (a GRPO group repeats its prompt G times), the caches and logits then expanded to
        one row per completion. Every distinct prompt is still left-padded to the width of the
        whole batch, as without dedup. decoder="auto" on a Qwen2 / Qwen3 / Llama model with the
        native step prefills through it (LeanStepper.native_prefill); otherwise the HF forward."""
        index, uniq, inv = {}, [], []
        for p in prompt_ids:
            key = tuple(p)
            if key not in index:
                index[key] = len(uniq)
                uniq.append(p)
            inv.append(index[key])
        width = max(len(p) for p in uniq)
        ids = torch.full((len(uniq), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(uniq), width), dtype=torch.long, device=device)
        for r, p in enumerate(uniq):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
            mask[r, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        lean = self.decoder != "hf" and LeanStepper.supports(model)
        native = None
        if lean and self.decoder == "auto":
            native = LeanStepper.native_prefill(model, ids, mask, max_new_tokens)
        inv_t = torch.tensor(inv, dtype=torch.long, device=device) if len(uniq) < len(prompt_ids) else None
        if native is not None:
            stepper, logits = native
            if inv_t is not None:
                stepper.select(inv_t)
        else:
            model.eval()  # _sample_batch restores the mode
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
            cache, logits = res.past_key_values, res.logits[:, -1, :].float()
            if inv_t is not None:
                cache.batch_select_indices(inv_t)
                mask = mask[inv_t]
            if lean:
                stepper = LeanStepper(model, cache, mask, max_new_tokens, native=self.decoder == "auto")
            else:
                stepper = HFStepper(model, cache, mask)
        if inv_t is not None:
            logits, pos = logits[inv_t], pos[inv_t]
        return stepper, logits, pos[:, -1] + 1

    def _native_sampler(self, device, logits: torch.Tensor):
        """the native sampler (csrc/jit/sampler.cpp) for decoder="auto" on CPU float32 logits where it builds
        (FASTGRPO_NATIVE_DECODE=0 keeps `pick`); "lean" and "hf" keep `pick` (the reference)."""
        if self.decoder != "auto" or device.type != "cpu" or logits.dtype != torch.float32:
            return None
        from fastgrpo.native.decode_step import decode_step_module

        return decode_step_module()

    def _loop(self, model, device, prompt_ids, sampling, max_new_tokens, seeds) -> List[Completion]:
        B = len(prompt_ids)
        stop_t = torch.tensor(sorted(self.eos_ids | set(sampling.stop_token_ids)), dtype=torch.long, device=device)
        stepper, logits, next_pos = self._prefill(model, device, prompt_ids, max_new_tokens)
        native = self._native_sampler(device, logits)
        temperature = float(sampling.temperature)
        # uniforms for every step, indexed by original row (compaction leaves them in place)
        u = None
        if temperature > 0:
            gens = [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]
            u = uniforms(gens, max_new_tokens, device)
        # top-k / top-p: the truncated logits come from process_logits, and the native sampler
        # draws from them at τ = 1; otherwise it divides by τ itself
        truncate = temperature > 0 and (0 < sampling.top_k < logits.shape[-1] or sampling.top_p < 1.0)
        u_native = u if u is not None else torch.empty((0, 0), dtype=torch.float32, device=device)
        out_tok = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        length = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(B, dtype=torch.bool, device=device)
        rows = torch.arange(B, device=device)          # original row of each batch row
        small_step = 2 * self._n_params() * B < _SMALL_STEP_FLOP
        alive = torch.ones(B, dtype=torch.bool, device=device)
        nxt = torch.empty(B, dtype=torch.long, device=device)
        n_alive = B
        hook = self.inflight
        v0 = hook.version if hook is not None else None
        swaps = []  # (first token index sampled under the new weights, their version)
        t_off = 0   # the decode step's slot is t - t_off (an abort's re-prefill starts the slots anew)
        for t in range(max_new_tokens):
            if native is not None:
                # draw, log-prob, out_tok / out_lp writes and the stop-token check in one call
                if truncate:
                    z, tau = process_logits(logits, temperature, sampling.top_k, sampling.top_p), 1.0
                else:
                    z, tau = logits, temperature
                n_done = native.sample_step(z.contiguous(), tau, u_native, t, rows, stop_t, nxt, alive, out_tok,
                                            out_lp, length, stopped)
            else:
                nxt, lp = pick(logits, temperature, sampling.top_k, sampling.top_p,
                               None if u is None else u[rows, t], process_logits, t)
                out_tok[rows, t] = nxt      # finished rows still in the batch write past their length
                out_lp[rows, t] = lp
                done = torch.isin(nxt, stop_t) & alive
                n_done = int(done.sum())
                if n_done:
                    fin = rows[done]
                    length[fin] = t + 1
                    stopped[fin] = True
                    alive &= ~done
            if sampling.stop:
                live = alive.tolist()
                for i, r in enumerate(rows.tolist()):
                    if live[i] and any(s in self._decode(out_tok[r, :t + 1].tolist()) for s in sampling.stop):
                        alive[i], length[r], stopped[r] = False, t + 1, True
                        n_done += 1
            n_alive -= n_done
            if t + 1 == max_new_tokens or n_alive == 0:
                break
            if len(rows) - n_alive >= _compact_at(len(rows), small_step):
                keep = alive.nonzero()[:, 0]
                # compaction: finished rows leave the batch, so the long tail computes live rows only
                rows, nxt, next_pos, alive = rows[keep], nxt[keep], next_pos[keep], alive[keep]
                stepper.select(keep)
            version = hook.poll() if hook is not None else None
            if version is not None:  # new weights were loaded into the model (in place) after token t
                swaps.append((t + 1, version))
                if hook.mode == "abort":  # the live rows resubmitted with their tokens so far
                    keep = alive.nonzero()[:, 0]
                    rows, nxt, alive = rows[keep], nxt[keep], alive[keep]  # nxt: the native sampler's output buffer
                    ids = [prompt_ids[r] + out_tok[r, :t + 1].tolist() for r in rows.tolist()]
                    stepper, logits, next_pos = self._prefill(model, device, ids, max_new_tokens - t - 1)
                    t_off = t + 1
                    continue
                stepper.reload_weights(model)  # keep: the cached keys / values stay, the next steps run new weights
            logits = stepper.step(nxt, next_pos, t - t_off)
            next_pos.add_(1)
        toks, lps = out_tok.tolist(), out_lp.tolist()
        lens, stop = length.tolist(), stopped.tolist()
        outs = [Completion(toks[r][:lens[r]], lps[r][:lens[r]], "stop" if stop[r] else "length",
                           self._decode(toks[r][:lens[r]])) for r in range(B)]
        if hook is not None:  # per-token versions: the call's first version, then each swap's from its first token
            for c in outs:
                c.token_versions = token_versions(len(c.token_ids), v0, swaps)
        return outs
