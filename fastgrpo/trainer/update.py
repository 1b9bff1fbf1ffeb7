"""The update half of a GRPO step (a mixin of `fastgrpo.trainer.grpo.Trainer`): pack the kept
groups into token-budget micro-batches, score the old / reference log-probs, run the K inner
updates (packed forward → fused loss → backward → clip → optimizer) and the guards that refuse an
update (non-finite loss or gradients, a gradient-norm spike, a weight-norm blow-up). Rollouts
sampled behind the policy (`_off_policy`) carry their sampling log-probs as `behav_logp` and are
corrected as algorithm.correction says (fastgrpo.correction: π_prox/μ weights, `async/*` metrics).

Split out of grpo.py (house rule: files under ~500 lines) with its behaviour unchanged; the
methods read and set the trainer's state (`cfg`, `backend`, `timers`, `loss_cfg`, counters).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from fastgrpo.correction import (add_sums, apply_correction, behaviour_weights, correction_metrics, correction_sums,
                                 empty_sums, proximal_weights, resolve_correction)
from fastgrpo.models.lora import adapter_disabled
from fastgrpo.models.packed import can_share_prefix, packing_attn_coef
from fastgrpo.packing import build_packed_batches, plan_micro_batches
from fastgrpo.rewards.process import token_advantages
from fastgrpo.trainer.backend import zero_weighted_loss
from fastgrpo.trainer.collectives import all_reduce_max, all_reduce_metrics, rebalance


class TrainingStopped(RuntimeError):
    """Raised when the run stops on purpose (too many non-finite steps, a blown-up update)."""


class UpdateMixin:
    def _pack(self, problems, groups, adv, keep):
        with self.timers.phase("pack"):
            # rollouts of an engine behind the policy: their sampling log-probs are the behaviour
            # policy μ's. Without a correction they are the loss's old log-probs (naive PPO:
            # importance ratio ≠ 1 from the first inner step); with one (fastgrpo.correction) they
            # travel as behav_logp and the old log-probs are π_prox, scored in _old_logp.
            # Otherwise the old log-probs are the policy's own (K = 1: the detached current ones;
            # K > 1: scored before the first update)
            corr = self._correction()
            behav = self._off_policy() or (corr != "none" and self.cfg.algorithm.correction_on_policy)
            stale = behav and corr == "none"
            self._correction_sums = empty_sums() if behav else None
            self._tokenize(problems)  # done by _rollout already, unless a caller packs other problems
            adv_rows = adv.tolist()  # Python floats once, not a tensor index per completion
            prompts, comps, advs, ids, cmask, olps = [], [], [], [], [], []
            for i, (p, grp) in enumerate(zip(problems, groups)):
                if not keep[i]:
                    continue
                pid = self._prompt_ids[p.id]
                for j, c in enumerate(grp):
                    # an episode (fastgrpo.rollout.episodes) carries its own prompt when reset() added an
                    # observation, and its forks (rollout.history=fork) train with their episode's advantage
                    for k, part in enumerate([c] + list(getattr(c, "forks", ()) or ())):
                        prompts.append(getattr(part, "prompt_ids", None) or pid)
                        advs.append(token_advantages(adv_rows[i][j], part))  # + dense step advantages
                        comps.append(part.token_ids)
                        ids.append((p.id, j + k * len(grp)))  # a fork's sample id follows the group's
                        cmask.append(part.sampled_mask)  # 0/1: forced and environment tokens carry no gradient
                        olps.append(part.logprobs if behav else None)
            lengths = [len(p) + len(c) for p, c in zip(prompts, comps)]
            # episodes whose prompt is not the group's (an environment's first observation, forks of
            # rollout.history=fork): no shared prefix; decided by every rank alike
            own_prompts = any(getattr(c, "prompt_ids", None) is not None or getattr(c, "forks", None)
                              for grp in groups for c in grp)
            if self.world_size > 1:
                own_prompts = all_reduce_max(int(own_prompts)) > 0
                # same number of sequences and near-equal tokens on every rank (Karmarkar–Karp):
                # without it the rank holding the longest groups sets everyone's step time
                recs = rebalance(list(zip(prompts, comps, advs, ids, cmask, olps)), lengths)
                prompts, comps, advs, ids, cmask, olps = (list(x) for x in zip(*recs)) if recs else ([], [], [], [], [], [])
                lengths = [len(p) + len(c) for p, c in zip(prompts, comps)]
            budget = self.cfg.packing.max_tokens
            # a shared prefix is one prompt per group: not for episodes whose prompts differ within one
            share = self._share_prefix() and not own_prompts
            # a sequence over the budget gets a micro-batch of its own instead of failing the step;
            # with shared prefixes whole groups go to one micro-batch (their prompt is then carried
            # once); every rank runs the same number of micro-batches (`agree`: the max over ranks)
            plan = plan_micro_batches(lengths, budget, allow_oversize=True, agree=all_reduce_max,
                                      groups=[key[0] for key in ids] if share else None)
            batches = build_packed_batches(prompts, comps, advs, budget, completion_mask=cmask, ids=ids,
                                           old_logp=olps if stale else None, behav_logp=olps if behav else None,
                                           allow_oversize=True,
                                           share_prefix=share, attn_coef=packing_attn_coef(self.backend.module),
                                           plan=plan)
            # this rank has fewer sequences than its peers: zero-weighted dummies keep collectives aligned
            batches += [None] * sum(1 for b in plan if not b)
        return batches

    def _before_weights_change(self) -> None:
        """Called right before the optimizer step changes the weights. AsyncTrainer: waits for a
        weight broadcast still reading them (sync.overlap)."""

    def _off_policy(self) -> bool:
        """Whether this step's rollouts were sampled by a behaviour policy behind the policy: the
        engine holds older weights (sync.every > 1, between syncs). AsyncTrainer: always."""
        return self._engine_stale

    def _correction(self) -> str:
        """The off-policy correction of this run (algorithm.correction with auto resolved):
        none | tis | decoupled (fastgrpo.correction)."""
        return resolve_correction(self.cfg.algorithm.correction, getattr(self.cfg.rollout, "mode", "") == "async")

    def _share_prefix(self) -> bool:
        return bool(self.cfg.packing.share_prefix) and can_share_prefix(self.backend.module)

    @torch.no_grad()
    def _logprobs_of(self, model, batch):
        from fastgrpo.loss import token_logprobs
        from fastgrpo.models.packed import packed_head_logits

        logits, cap = packed_head_logits(model, batch)  # a head's soft cap is applied in the kernel, as in the loss
        logp, _ = token_logprobs(logits, batch.targets.to(logits.device), self.loss_cfg.temperature,
                                 impl=self.cfg.algorithm.loss_impl, softcap=cap)
        return logp.float().cpu()

    def _old_logp(self, batches):
        # an off-policy correction weights by π_prox/μ: at K > 1 π_prox is scored here; at K = 1 it is
        # the policy being differentiated, read from the loss step's own logits (_loss_fn: no forward)
        corr = self._correction() if getattr(self, "_correction_sums", None) is not None else "none"
        need_old = self.cfg.algorithm.inner_steps > 1
        with self.timers.phase("old_logp"):
            model = self.backend.module
            was = model.training
            model.eval()
            for b in batches:
                if b is None:
                    continue
                if b.old_logp is not None:
                    pass  # the rollout's own log-probs (an engine behind the policy, see _pack)
                elif need_old and self._zero3():  # inside the engine's forward ZeRO-3 gathers layer by layer
                    b.old_logp = self.backend.forward(self._logprobs_of, b)
                elif need_old:
                    b.old_logp = self._logprobs_of(model, b)
                if corr != "none" and b.behav_logp is not None and b.old_logp is not None:  # detached, truncated
                    add_sums(self._correction_sums, apply_correction(b, corr, self.cfg.algorithm.is_cap))
                if self.ref_model is not None:
                    with adapter_disabled(self.ref_model):  # LoRA: the base (PEFT's disable_adapter); else a no-op
                        b.ref_logp = self._logprobs_of(self.ref_model, b)
            model.train(was)

    def _loss_fn(self, totals):
        from fastgrpo.loss import grpo_loss, token_logprobs
        from fastgrpo.models.packed import lm_head_logits, packed_forward

        cfg = self.cfg
        state = self._update_state
        corr = self._correction() if getattr(self, "_correction_sums", None) is not None else "none"
        naive_stats = getattr(self, "_correction_sums", None) is not None and corr == "none"

        def fn(model, b):
            dev = model.get_input_embeddings().weight.device
            b = b.to(dev)
            hidden = packed_forward(model, b)
            if not bool(torch.isfinite(hidden).all()):
                state.nonfinite = True
                return zero_weighted_loss(model, hidden)
            # the logits of the model's forward (old / ref log-probs) but for the cap, which the loss applies
            logits = lm_head_logits(model, hidden, softcap=False)
            token_mean = self.loss_cfg.loss_agg == "token-mean"
            try:
                weights = b.weights
                if corr != "none" and b.behav_logp is not None and b.old_logp is None:
                    # K = 1: π_prox is this forward's policy; its log-probs come from these logits
                    prox, _ = token_logprobs(logits.detach(), b.targets, self.loss_cfg.temperature,
                                             impl=cfg.algorithm.loss_impl, softcap=self.loss_cfg.softcap)
                    weights, part = proximal_weights(prox, b.behav_logp, b.loss_mask, corr, cfg.algorithm.is_cap,
                                                     weights)
                    add_sums(self._correction_sums, part)
                out = grpo_loss(logits, b.targets, b.advantages, mask=b.loss_mask, old_logp=b.old_logp,
                                ref_logp=b.ref_logp, weights=weights, cu_seqlens=b.loss_cu_seqlens,
                                config=self.loss_cfg, num_items=totals["tokens"] if token_mean else None,
                                impl=cfg.algorithm.loss_impl,
                                return_entropy=True, inplace_backward=True)  # logits are not read again
            except ValueError as e:  # the loss's own finiteness check (non-finite logits rows)
                if "NaN or Inf" not in str(e):
                    raise
                state.nonfinite = True
                return logits[..., :1, :].float().sum() * 0.0  # on the graph built: see zero_weighted_loss
            # token-mean is normalised by the global token count already; per-sequence means are
            # per micro-batch, so weight each by its share of the global sequences
            scale = self.backend.loss_scale * (1.0 if token_mean else b.num_seqs / totals["seqs"])
            loss = out.loss * scale
            if not bool(torch.isfinite(loss)):
                state.nonfinite = True
                return loss * 0.0
            if naive_stats and getattr(state, "first", False) and b.behav_logp is not None:
                # naive PPO's metrics: the first inner step's log-probs are π_prox (nothing applied yet)
                rho, trunc = behaviour_weights(out.logp, b.behav_logp, "none", cfg.algorithm.is_cap, b.loss_mask)
                add_sums(self._correction_sums, correction_sums(out.logp, b.behav_logp, rho, trunc, b.loss_mask))
            w = float(b.loss_mask.sum())
            state.tokens += w
            state.loss += float(out.loss.detach()) * scale / self.backend.loss_scale  # this rank's share of the batch loss
            for k, v in out.metrics.items():
                if k.endswith("_min") or k.endswith("_max"):  # extremes combine by min / max, not by mean
                    pick = min if k.endswith("_min") else max
                    state.extremes[k] = pick(state.extremes.get(k, float(v)), float(v))
                else:
                    state.sums[k] = state.sums.get(k, 0.0) + float(v) * w
            return loss

        return fn

    def _grads_finite(self) -> bool:
        """This rank's share of the gradients is finite (no collective: the caller max-reduces).
        The backend knows where its gradients live (ZeRO: partitions, `p.grad` is None)."""
        if hasattr(self.backend, "local_grads_finite"):
            return self.backend.local_grads_finite()
        for p in self.backend.module.parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return False
        return True

    def _update(self, batches):
        local = {"tokens": sum(b.num_loss_tokens for b in batches if b is not None),
                 "seqs": sum(b.num_seqs for b in batches if b is not None)}
        totals = all_reduce_metrics(local, op="sum")
        totals["tokens"] = max(totals["tokens"], 1.0)
        totals["seqs"] = max(totals["seqs"], 1.0)
        logs = {}
        with self.timers.phase("update"):
            if not batches:  # every group had σ = 0 on every rank: nothing to learn from this batch
                return {"train/no_update": 1.0}
            self.backend.module.train()
            for inner in range(self.cfg.algorithm.inner_steps):
                self._update_state = SimpleNamespace(nonfinite=False, tokens=0.0, loss=0.0, sums={}, extremes={},
                                                     first=inner == 0)
                self.backend.accumulate(batches, self._loss_fn(totals))
                st = self._update_state
                bad = all_reduce_metrics({"bad": float(st.nonfinite or not self._grads_finite())}, op="max")["bad"]
                if bad:
                    self.backend.discard_gradients()  # under ZeRO the reduced grads live in DeepSpeed's buffers
                else:
                    before = self._weight_norm() if self.cfg.guard.max_weight_growth else None
                    self._before_weights_change()
                    logs["train/grad_norm"] = self.backend.step(accept=self._grad_guard)
                    # finite gradients whose global norm overflowed (or spiked): step() refused them
                    bad = bool(getattr(self.backend, "last_step_skipped", False))
                    self._weights_changed = self._weights_changed or not bad
                    if before is not None and not bad:
                        self._check_weight_growth(before)
                if bad and self._spiked:  # refused by the spike guard (reported there), not non-finite
                    self._spiked = False
                    self.spike_skips += 1
                    logs["train/spike_skipped"] = 1.0
                    break
                if bad:
                    self.nan_skips += 1
                    logs["train/skipped"] = 1.0
                    self.log(f"[fastgrpo] step {self.step_num}: non-finite loss or gradient, update skipped "
                             f"({self.nan_skips}/{self.cfg.max_nan_skips})")
                    break
                n = max(st.tokens, 1.0)
                logs["train/loss"] = st.loss
                logs.update({f"loss/{k}": v / n for k, v in st.sums.items()})
                logs.update({f"loss/{k}": v for k, v in st.extremes.items()})
            if getattr(self, "_correction_sums", None) is not None:  # off-policy: async/* (fastgrpo.correction)
                logs.update(correction_metrics(all_reduce_metrics(self._correction_sums, op="sum")))
        return logs

    # ------------------------------------------------------------------ guards
    def _weight_norm(self) -> float:
        """Global L2 norm of the weights (ZeRO-3: of the partitions, summed over ranks)."""
        params = [p.detach() for p in self.backend.module.parameters() if p.numel()]
        sq = torch.stack([n.float() for n in torch._foreach_norm(params)]).pow(2).sum() if params else torch.zeros(())
        if self._zero3():
            sq = torch.tensor(all_reduce_metrics({"sq": float(sq)}, op="sum")["sq"])
        return float(sq.sqrt())

    def _check_weight_growth(self, before: float) -> None:
        """The blow-up guard: an update that grows the weight norm by more than
        guard.max_weight_growth (a learning rate far too high: finite gradients, clipped, and
        still weights of 1e6) stops the run before anything of that model is checkpointed or
        synced; the last checkpoint stays the newest."""
        after = self._weight_norm()
        limit = self.cfg.guard.max_weight_growth
        if not math.isfinite(after) or (before > 0 and after > limit * before):
            raise TrainingStopped(
                f"stopped at step {self.step_num}: the update grew the weight norm from {before:.4g} to {after:.4g} "
                f"(more than guard.max_weight_growth={limit}×): the model blew up — optimizer.lr="
                f"{self.cfg.optimizer.lr:g} is likely too high; nothing of this model was checkpointed")

    def _grad_guard(self, norm: float) -> bool:
        """Whether to apply an update of gradient norm `norm` (guard.grad_spike × the median of
        the last 20 accepted norms, after guard.grad_spike_warmup of them)."""
        g = self.cfg.guard
        hist = self._grad_norms
        ok = True
        if g.grad_spike and len(hist) >= max(1, g.grad_spike_warmup):
            med = float(np.median(hist[-20:]))
            ok = not (med > 0 and norm > g.grad_spike * med)
            if not ok:
                self._spiked = True
                self.log(f"[fastgrpo] step {self.step_num}: gradient norm {norm:.4g} is more than guard.grad_spike="
                         f"{g.grad_spike}× the recent median {med:.4g}: update skipped")
        if ok and math.isfinite(norm):
            hist.append(norm)
            del hist[:-20]
        return ok
