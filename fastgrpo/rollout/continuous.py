"""Continuous batching of episode turns on the built-in engine, with each episode's KV cache kept
between its turns.

`TurnBatcher` serves turns (`submit(key, context ids, cap, seed)`) and returns each finished turn
as a `Completion` from `step()`, one decode step of every row in the running batch at a time. A
turn that arrives while others decode joins the running batch at the next admission (its new ids
prefilled in one batched forward, the batch's caches re-laid out once), instead of waiting for
the next engine call; a turn that ends leaves at once and its keys / values are kept under its
key, so the episode's next turn prefills only what the environment appended (the close of the
turn, the tool's answer, the next header) instead of the whole conversation. The grouped path of
fastgrpo.rollout.episodes re-prefilled the ledger every turn (SmolLM2-135M on one CPU thread:
turns 2 and 3 of a 16-episode benchmark took 1.9 / 2.4 s against 0.8 s for turn 1).

Layout: the decode steps are `LeanStepper`'s (decoders.py: Qwen2 / Qwen3 / Llama, native on CPU
float32 where it builds). Its static cache has one write slot per step for all rows and an
additive bias per (row, slot), so rows of different lengths sit left-padded and a row's real
keys need not be contiguous: a prefilled row carries holes (its past left-padded, its new ids
right-padded in the same forward) which the bias masks. An admission gathers every live row's
real keys / values into a fresh, compactly left-padded stepper (one gather per layer per block),
so padding and finished rows do not accumulate. A row always holds one id not yet fed (the last
id of its context, then each sampled id): a step feeds it and samples the next, so rows admitted
from a prefill and rows mid-turn step together. Each turn's ids are exactly what was sampled; a
token's log-prob is under the processed distribution (base.py), as in `TorchEngine._sample`.

Sampling: one uniform per (turn, token) from `torch.Generator(seed)` (the turn's seed, as
`TorchEngine._sample` draws it: the same seed gives the same uniforms), inverse-CDF through
`decoders.pick`. The keys / values come from a different sequence of float32 operations than a
fresh `_sample` of the same context (a batched prefill with a past, other rows' padding), so a
turn may differ from a fresh call in the last bits of its log-probs; the float64 oracle bounds
both (tests/rollout/test_engine_episodes.py).

Memory: the caches kept between turns hold at most `cache_bytes` (default a quarter of the memory
free when the batcher starts: the GPU's on CUDA, else the machine's; SmolLM2-135M float32 keeps
46 KB per id); over it the longest-kept caches go first (`stats["evicted"]`), and those episodes'
next turns prefill their whole context, as the grouped loop does every turn.

Weights that change between steps (an async worker's rollout.inflight=keep | abort, polled by the
runner): `weights_changed("keep")` reloads the stepper's weights and keeps the running rows'
keys / values (as `TorchEngine._sample` does mid-call); "abort" re-prefills the running rows
under the new weights; both drop the kept caches of episodes between turns (their next turn
prefills under the new weights).

Admission policy: a batch with rows running admits waiting turns once the turns an admission
could take now (the waiting ones that fit in the free rows) are at least half of the running
rows, or the oldest has waited `_ADMIT_WAIT` (16) steps with a row free (an admission copies
every live row's cache once: at 16 rows x 300 positions on SmolLM2-135M that is ~220 MB, and a
prefill of a few rows costs little more than of one); an empty batch admits at once. Counting
what fits rather than the queue's length matters when episodes queue for rows (more live
episodes than `engine.max_batch_size`): a full batch no longer re-lays itself out for each row
that frees (bench_tools, 32 episodes on 16 rows, 8-token turns: 15 admissions -> 6, engine CPU
9.1 s -> 7.3 s on SmolLM2-135M, one CPU thread). Against admitting at a quarter / 4 steps, the
share cut the prefill time of the stop-string benchmark by ~40 %. `admit_s`, the last
admission's seconds, is how long the runner's idle engine waits for more tool answers before
admitting (fastgrpo.rollout.episodes: at most the cost of the admission it saves).
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from fastgrpo.rollout.base import Completion, SamplingConfig
from fastgrpo.rollout.decoders import LeanStepper, pick
from fastgrpo.rollout.torch_engine import process_logits

_ADMIT_WAIT = 16    # decode steps a waiting turn may wait while a batch runs
_ADMIT_SHARE = 2    # waiting turns admitted once those that fit are 1/_ADMIT_SHARE of the running rows
_SLOTS_AHEAD = 64   # decode slots a layout allocates beyond its widest row


def _nbytes(entry) -> int:
    return sum(t.numel() * t.element_size() for part in entry[1:] for t in part)


def _cache_budget(device) -> int:
    """Bytes the kept caches of episodes between turns may hold: a quarter of the memory free
    now (the device's on CUDA, else the machine's). Over it, the longest-kept go first."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0] // 4)
        import psutil

        return int(psutil.virtual_memory().available // 4)
    except Exception:  # noqa: BLE001 — no reading: 2 GiB
        return 2 << 30


class _Row:
    """One turn in service. `known`: the context then the ids sampled so far; its last id is the
    one the next step feeds. `past`: (n, K per layer [Hkv, n, D], V ...) of known[:n], or None."""

    __slots__ = ("key", "known", "n_ctx", "cap", "u", "out", "lps", "vers", "past", "alive")

    def __init__(self, key, context: List[int], cap: int, u: Optional[torch.Tensor], past):
        self.key, self.known, self.n_ctx, self.cap, self.u = key, list(context), len(context), cap, u
        self.out: List[int] = []
        self.lps: List[float] = []
        self.vers: List[Optional[int]] = []
        self.past, self.alive = past, True


class TurnBatcher:
    """Turns of many episodes decoded together on `engine` (a TorchEngine whose model LeanStepper
    supports: `supports(engine)`), each turn with its own cap and seed. `version`: a callable
    giving the weights' version now (each sampled id is tagged with it), or None. `turn_tokens`:
    a turn that samples this many ids ends as at a stop string (a fixed turn length for the
    benchmark; the episode's budget still ends a turn as "length")."""

    def __init__(self, engine, sampling: SamplingConfig, version=None, turn_tokens: Optional[int] = None,
                 cache_bytes: Optional[int] = None):
        self.engine, self.sampling, self.version = engine, sampling, version
        self.turn_tokens = turn_tokens
        self.model = engine.model
        self.device = next(self.model.parameters()).device
        self.stop_ids = set(engine.eos_ids) | set(sampling.stop_token_ids)
        self.saved: Dict[object, Tuple[List[int], list, list]] = {}  # key -> (ids, K, V) between turns
        self.saved_bytes = 0
        self.cache_bytes = _cache_budget(self.device) if cache_bytes is None else int(cache_bytes)
        self.queue: List[_Row] = []      # turns waiting for admission
        self.rows: List[_Row] = []       # the stepper's rows, in order (finished ones until compaction)
        self.st: Optional[LeanStepper] = None
        self.cur = 0                     # the next slot a step writes
        self.waited = 0                  # steps the oldest waiting turn has waited
        self._weights: Optional[LeanStepper] = None  # the last stepper: its prepared weights serve the next
        self.stats = {"steps": 0, "admissions": 0, "prefill_ids": 0, "reused_ids": 0, "evicted": 0}
        self.admit_s = 0.0               # seconds the last admission took (the runner's wait window)

    @staticmethod
    def supports(engine) -> bool:
        model = getattr(engine, "model", None)
        return (model is not None and getattr(engine, "decoder", "hf") != "hf" and hasattr(engine, "eos_ids")
                and LeanStepper.supports(model))

    # ------------------------------------------------------------------ requests
    def submit(self, key, context, cap: int, seed: Optional[int]) -> None:
        """Queue a turn of episode `key` on `context` (its ids so far), at most `cap` sampled ids. Its
        kept cache serves when the kept ids are a prefix of `context`."""
        context = [int(i) for i in context]
        if not context:
            raise ValueError(f"turn of episode {key!r}: empty context")
        if cap < 1:
            raise ValueError(f"turn of episode {key!r}: cap={cap} (expected >= 1)")
        saved = self._unsave(key)
        past = None
        if saved is not None and len(saved[0]) < len(context) and context[:len(saved[0])] == saved[0]:
            past = (len(saved[0]), saved[1], saved[2])
        u = None
        if self.sampling.temperature > 0:
            u = torch.empty(cap, dtype=torch.float32, device=self.device)
            if seed is None:
                u.uniform_()
            else:
                u.uniform_(generator=torch.Generator(device=self.device).manual_seed(seed))
        self.queue.append(_Row(key, context, cap, u, past))

    def forget(self, key) -> None:
        """The episode ended: drop its kept cache."""
        self._unsave(key)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(r.alive for r in self.rows)

    def running(self) -> List[object]:
        return [r.key for r in self.rows if r.alive]

    def room(self) -> int:
        """Rows free for waiting turns: at most `engine.max_batch_size` run together."""
        return self.engine.max_batch_size - sum(r.alive for r in self.rows)

    def weights_changed(self, mode: str = "keep") -> None:
        """New weights were loaded into the model in place (see the module docstring)."""
        self.saved.clear()
        self.saved_bytes = 0
        self._weights = None
        if self.st is None:
            return
        if mode == "abort":
            live = [r for r in self.rows if r.alive]
            for r in live:
                r.past = None
            self.queue = live + self.queue
            self.rows, self.st, self.cur = [], None, 0
        else:
            self.st.reload_weights(self.model)
            self._weights = self.st

    def close(self) -> None:
        self.saved.clear()
        self.saved_bytes = 0
        self.queue, self.rows, self.st = [], [], None

    # ------------------------------------------------------------------ one step
    def step(self) -> List[Tuple[object, Completion]]:
        """Admit waiting turns (by the policy above), run one decode step of the running batch, and
        return the turns that ended with it as (key, Completion)."""
        model = self.model
        was_training = model.training
        try:
            with torch.inference_mode():
                return self._step()
        finally:
            if model.training != was_training:
                model.train(was_training)

    def _step(self) -> List[Tuple[object, Completion]]:
        n_alive = sum(r.alive for r in self.rows)
        if self.queue:
            room = self.room()
            fits = min(room, len(self.queue))  # turns an admission now would take
            if fits > 0 and (n_alive == 0 or fits >= max(1, n_alive // _ADMIT_SHARE) or self.waited >= _ADMIT_WAIT):
                self._admit(room)
                self.waited = 0
            elif fits > 0:
                self.waited += 1
        live = [i for i, r in enumerate(self.rows) if r.alive]
        if not live:
            return []
        if self.cur >= self.st.bias.shape[1]:  # every slot written: lay the batch out again, with room
            self._admit(0)
            live = list(range(len(self.rows)))
        pad = self.engine.pad_id
        feed = torch.tensor([r.known[-1] if r.alive else pad for r in self.rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([len(r.known) - 1 if r.alive else 0 for r in self.rows], dtype=torch.long,
                           device=self.device)
        logits = self.st.step(feed, pos, self.cur - self.st.width)
        self.cur += 1
        self.stats["steps"] += 1
        s = self.sampling
        idx = torch.tensor(live, dtype=torch.long, device=self.device)
        rows = [self.rows[i] for i in live]
        u = None if s.temperature == 0 else torch.stack([r.u[len(r.out)] for r in rows])
        nxt, lp = pick(logits[idx] if len(live) < len(self.rows) else logits, float(s.temperature), s.top_k, s.top_p,
                       u, process_logits, self.stats["steps"])
        version = self.version() if self.version is not None else None
        done = []
        for i, r, y, l in zip(live, rows, nxt.tolist(), lp.tolist()):
            r.out.append(y)
            r.lps.append(l)
            r.vers.append(version)
            r.known.append(y)
            reason = None
            if y in self.stop_ids or (self.turn_tokens is not None and len(r.out) >= self.turn_tokens
                                      and len(r.out) < r.cap):
                reason = "stop"
            elif s.stop and any(t in self.engine._decode(r.out) for t in s.stop):
                reason = "stop"
            elif len(r.out) >= r.cap:
                reason = "length"
            if reason is not None:
                done.append(self._finish(i, r, reason))
        dead = len(self.rows) - sum(r.alive for r in self.rows)
        if dead and dead >= max(1, len(self.rows) // 4):
            keep = [i for i, r in enumerate(self.rows) if r.alive]
            if keep:
                self.st.select(torch.tensor(keep, dtype=torch.long, device=self.device))
                self.rows = [self.rows[i] for i in keep]
            else:
                self.rows, self.st, self.cur = [], None, 0
        return done

    def _finish(self, i: int, r: _Row, reason: str) -> Tuple[object, Completion]:
        """End row `i`'s turn: keep its keys / values (every id it holds but the last sampled one)."""
        r.alive = False
        valid = (self.st.bias[i, :self.cur] == 0).nonzero()[:, 0]
        fed = r.known[:-1]
        if valid.numel() != len(fed):  # a layout bug, never the model's output
            raise RuntimeError(f"turn batcher: episode {r.key!r} holds {valid.numel()} cached positions for "
                               f"{len(fed)} ids")
        ks, vs = self._slot_views()
        entry = (fed, [k[i][:, valid].clone() for k in ks], [v[i][:, valid].clone() for v in vs])
        self.saved[r.key] = entry  # submit() took the previous one out
        self.saved_bytes += _nbytes(entry)
        while self.saved_bytes > self.cache_bytes and self.saved:
            # over the budget: the longest-kept caches go (their episodes' next turns prefill all)
            self._unsave(next(iter(self.saved)))
            self.stats["evicted"] += 1
        c = Completion(list(r.out), list(r.lps), reason, self.engine._decode(r.out))
        if self.version is not None:
            c.token_versions = list(r.vers)
            c.policy_version = r.vers[0]
        return r.key, c

    def _unsave(self, key):
        entry = self.saved.pop(key, None)
        if entry is not None:
            self.saved_bytes -= _nbytes(entry)
        return entry

    def _slot_views(self):
        """The stepper's K / V per layer as [B, Hkv, S, D] views (the native step stores K as
        [B, Hkv, D, S])."""
        st = self.st
        ks = [k.transpose(2, 3) for k in st.k] if st.native is not None else st.k
        return ks, st.v

    # ------------------------------------------------------------------ admission
    def _admit(self, room: int) -> None:
        """Prefill up to `room` waiting turns and re-lay the running batch and them out into one
        fresh stepper (room 0: the running batch alone, when its slots ran out)."""
        t0 = time.perf_counter()
        new, self.queue = self.queue[:room], self.queue[room:]
        blocks = []   # (rows, K per layer [b, Hkv, w, D], V, valid [b, w] bool)
        old = [r for r in self.rows if r.alive]
        if old:
            keep = [i for i, r in enumerate(self.rows) if r.alive]
            ks, vs = self._slot_views()
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            valid = self.st.bias[sel, :self.cur] == 0
            blocks.append((old, [k[sel, :, :self.cur] for k in ks], [v[sel, :, :self.cur] for v in vs], valid))
        if new:
            blocks.append(self._prefill(new))
        rows = [r for b in blocks for r in b[0]]
        counts = torch.cat([b[3].sum(1) for b in blocks])
        width = int(counts.max())
        # slots for the next steps: what the longest turn may still take, at most _SLOTS_AHEAD (a
        # turn's cap is what its episode's budget has left, mostly far more than the turn takes:
        # the batch is laid out again with more room when they are written)
        extra = min(_SLOTS_AHEAD, max(self._left(r) for r in rows))
        mask = torch.arange(width, device=self.device)[None, :] >= (width - counts)[:, None]
        st = LeanStepper(self.model, None, mask.long(), extra, native=self.engine.decoder == "auto",
                         weights_from=self.st if self.st is not None else self._weights)
        self._weights = st
        ks = [k.transpose(2, 3) for k in st.k] if st.native is not None else st.k
        off = 0
        for b_rows, bk, bv, valid in blocks:
            idx = self._gather_index(valid, width)
            n = len(b_rows)
            for dst_k, dst_v, src_k, src_v in zip(ks, st.v, bk, bv):
                e = idx[:, None, :, None].expand(n, src_k.shape[1], width, src_k.shape[3])
                dst_k[off:off + n, :, :width] = src_k.gather(2, e)
                dst_v[off:off + n, :, :width] = src_v.gather(2, e)
            off += n
        self.st, self.rows, self.cur = st, rows, width
        self.stats["admissions"] += 1
        self.admit_s = time.perf_counter() - t0

    def _left(self, r: _Row) -> int:
        cap = r.cap if self.turn_tokens is None else min(r.cap, self.turn_tokens)
        return max(1, cap - len(r.out))

    def _gather_index(self, valid: torch.Tensor, width: int) -> torch.Tensor:
        """[b, width]: for each row its valid slots, right-aligned (slot 0 on the left padding, which
        the new stepper's bias masks)."""
        b, w = valid.shape
        n = valid.sum(1)
        # the valid slots of a row in order: sort slot numbers with invalid ones pushed to the front
        slots = torch.arange(w, device=valid.device).expand(b, w)
        order = torch.where(valid, slots, slots - w).sort(dim=1).values.clamp(min=0)  # valid ones last, ascending
        idx = torch.zeros((b, width), dtype=torch.long, device=valid.device)
        take = min(w, width)
        idx[:, width - take:] = order[:, w - take:]
        pad = torch.arange(width, device=valid.device)[None, :] < (width - n)[:, None]
        return idx.masked_fill(pad, 0)

    def _prefill(self, new: List[_Row]):
        """(rows, K, V, valid) of the new rows: one forward over each row's ids not yet cached
        (known[n:-1], on its kept past), identical first turns (a group's prompt) computed once."""
        model = self.model
        uniq, inv, seen = [], [], {}
        for r in new:
            key = None if r.past is not None else tuple(r.known[:-1])
            if key is not None and key in seen:
                inv.append(seen[key])
                continue
            if key is not None:
                seen[key] = len(uniq)
            inv.append(len(uniq))
            uniq.append(r)
        P = max((r.past[0] for r in uniq if r.past is not None), default=0)
        news = [r.known[(r.past[0] if r.past is not None else 0):-1] for r in uniq]
        M = max(len(x) for x in news)
        u = len(uniq)
        self.stats["prefill_ids"] += sum(len(x) for x in news)
        self.stats["reused_ids"] += sum(r.past[0] for r in uniq if r.past is not None)
        layers = self.model.config.num_hidden_layers
        attn = self.model.model.layers[0].self_attn
        hk, d = self.model.config.num_key_value_heads, attn.head_dim
        dtype = self.model.model.embed_tokens.weight.dtype
        valid = torch.zeros((u, P + M), dtype=torch.bool, device=self.device)
        for j, (r, x) in enumerate(zip(uniq, news)):
            n = r.past[0] if r.past is not None else 0
            valid[j, P - n:P + len(x)] = True
        pk = [torch.zeros((u, hk, P, d), dtype=dtype, device=self.device) for _ in range(layers)]
        pv = [torch.zeros_like(t) for t in pk]
        if P:
            for j, r in enumerate(uniq):
                if r.past is not None:
                    n = r.past[0]
                    for li in range(layers):
                        pk[li][j, :, P - n:] = r.past[1][li]
                        pv[li][j, :, P - n:] = r.past[2][li]
        if M == 0:  # every new id is cached: the rows' blocks are their pasts
            ks, vs = pk, pv
        else:
            from transformers import DynamicCache

            ids = torch.full((u, M), self.engine.pad_id, dtype=torch.long, device=self.device)
            pos = torch.zeros((u, M), dtype=torch.long, device=self.device)
            for j, (r, x) in enumerate(zip(uniq, news)):
                n = r.past[0] if r.past is not None else 0
                if x:
                    ids[j, :len(x)] = torch.tensor(x, dtype=torch.long, device=self.device)
                pos[j] = n + torch.arange(M, device=self.device)
            cache = None
            if P:
                cache = DynamicCache(config=model.config)
                for li in range(layers):
                    cache.update(pk[li], pv[li], li)
            model.eval()  # step() restores the mode
            res = model(input_ids=ids, attention_mask=valid.long(), position_ids=pos, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            out = res.past_key_values
            ks = [out.layers[li].keys for li in range(layers)]
            vs = [out.layers[li].values for li in range(layers)]
        if u < len(new):
            sel = torch.tensor(inv, dtype=torch.long, device=self.device)
            ks, vs, valid = [k[sel] for k in ks], [v[sel] for v in vs], valid[sel]
        for r in new:
            r.past = None
        return new, ks, vs, valid
