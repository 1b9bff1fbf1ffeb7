"""One rank of the distributed CI test (launched by torchrun from test_distributed.py), or the
single-process reference that replays every rank's rollouts on one model.

Each rank makes its own synthetic rollouts (prompt/completion token ids, rewards → per-group
z-score advantages), the backend rebalances them across ranks, packs them into the same
number of micro-batches per rank, and trains `--steps` GRPO steps with fastgrpo's loss
(token-mean over all ranks' tokens). Writes the final flat weights of this rank (and
the number of micro-batches of its last step) to <out>/<backend>_<stage>_<opt>_rank<r>.pt, or
the replay's to <out>/reference_<opt>.pt. `trainer:<stage>:adamw` runs fastgrpo's Trainer
instead (run_trainer) and records what the test checks: weights before / after, optimizer
steps, skipped steps, sequences per step, curriculum state, reference weights, resumed weights.
"""
import argparse
import os
import sys

import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.trainer.backend import DistributedBackend, shutdown
from fastgrpo.trainer.collectives import all_gather, all_reduce_metrics, rebalance
from fastgrpo.packing import plan_micro_batches
from fastgrpo.loss import LossConfig, grpo_loss
from fastgrpo.models.packed import packed_forward
from fastgrpo.packing import build_packed_batches

G = 4  # samples per prompt
PROMPTS_PER_RANK = 3
BUDGET = 64  # token budget of a micro-batch: several micro-batches per rank


def rollouts(src_rank: int, step: int, vocab: int):
    """Deterministic synthetic rollouts of one rank: records (prompt, completion, advantage)."""
    g = torch.Generator().manual_seed(1000 * step + src_rank)
    recs = []
    for _ in range(PROMPTS_PER_RANK):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g)
        rewards = torch.rand(G, generator=g)
        adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4)
        for j in range(G):
            comp = torch.randint(3, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
            recs.append((prompt.tolist(), comp.tolist(), float(adv[j])))
    return recs


def loss_fn(model, batch, num_items, scale):
    h = packed_forward(model, batch)
    logits = model.get_output_embeddings()(h)
    out = grpo_loss(logits, batch.targets, batch.advantages, mask=batch.loss_mask,
                    cu_seqlens=batch.loss_cu_seqlens, config=LossConfig(), num_items=num_items)
    out.loss = out.loss * scale
    return out


def train(backend: DistributedBackend, steps: int, ranks_to_replay):
    vocab = backend.module.config.vocab_size
    for step in range(steps):
        recs = [r for src in ranks_to_replay for r in rollouts(src, step, vocab)]
        recs = rebalance(recs, [len(p) + len(c) for p, c, _ in recs])
        local_tokens = sum(len(c) for _, c, _ in recs)
        total = all_reduce_metrics({"tokens": local_tokens}, op="sum")["tokens"]
        counts = all_gather(len(recs))
        if len(set(counts)) != 1:  # rebalance gives every rank the same number of sequences
            raise RuntimeError(f"rebalance left unequal sequence counts per rank: {counts}")
        plan = plan_micro_batches([len(p) + len(c) for p, c, _ in recs], BUDGET)
        batches = []
        for idx in plan:
            if not idx:
                batches.append(None)
                continue
            sub = [recs[i] for i in idx]
            (b,) = build_packed_batches([p for p, _, _ in sub], [c for _, c, _ in sub], [a for _, _, a in sub], BUDGET)
            batches.append(b)
        fn = lambda m, b: loss_fn(m, b, total, backend.loss_scale)  # noqa: E731
        if step == 0:  # a skipped step (as for a non-finite loss) must leave no trace
            backend.accumulate(batches, fn)
            backend.discard_gradients()
        backend.accumulate(batches, fn)
        backend.step()
    return len(plan)


def build(opt_name: str):
    model, _ = build_tiny_model(seed=0)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    else:  # SGD is linear in the gradient, so a wrong gradient scale shows in the weights
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, opt


def flat_weights(backend: DistributedBackend) -> torch.Tensor:
    return torch.cat([v.flatten().float() for _, v in sorted(backend.full_state_dict().items())])


TRAINER_STEPS = 3  # step 1 is poisoned (skipped); ZeRO-2 updates at steps 2 and 3, ZeRO-3 at step 3


def trainer_cfg(out_dir: str, stage: int, *extra):
    from fastgrpo.config import load_config

    return load_config(overrides=[
        f"steps={TRAINER_STEPS}", "sft_first=false", "rollout.engine=torch", "rollout.group_size=4",
        # 3 prompts on 2 ranks: shards of 1 and 2 groups (4 and 8 sequences) until rebalanced
        "rollout.prompts_per_step=3", "rollout.max_new_tokens=8", "rewards.functions=[length]",
        "rewards.weights=[1.0]", "algorithm.max_pass_rate=1.0", "algorithm.drop_zero_std=false", "optimizer.lr=0.01",
        "distributed.backend=deepspeed", f"distributed.zero_stage={stage}", "packing.max_tokens=48",
        f"logging.out_dir={out_dir}", "logging.tensorboard=false", "logging.plots=false",
        "logging.progress=false", "checkpoint.at_end=false", "checkpoint.resume=none", *extra])


def make_trainer(cfg):
    """fastgrpo's Trainer on the arithmetic task. The reward is the completion length
    (normalised): a random model earns no accuracy, and a reward that varies inside a group is
    what makes the update non-zero. Records the sequences this rank trains on per step."""
    from fastgrpo.trainer.build import build_task
    from fastgrpo.trainer.grpo import Trainer

    task = build_task(cfg.data)
    fns = task.reward_fns()
    fns["length"] = lambda completions, answers=None: [min(len(c), 16) / 16 for c in completions]
    task.reward_fns = lambda: fns
    trainer = Trainer(cfg, task=task, log=lambda *_: None)
    trainer.seqs_per_step = []
    pack = trainer._pack

    def counting_pack(*a):
        batches = pack(*a)
        trainer.seqs_per_step.append(sum(b.num_seqs for b in batches if b is not None))
        return batches

    trainer._pack = counting_pack
    return trainer


def poison(trainer, where: str, step: int):
    """NaN on rank 1 only during the update of trainer step `step`: in a gradient (`grad`: the loss is
    finite, only the reduced ZeRO gradient partitions show it) or in the hidden states
    (`hidden`: the trainer's zero-weighted stand-in loss runs, under ZeRO-3 on partitioned
    parameters)."""
    model = trainer.backend.module
    if trainer.rank != 1:
        return
    if where == "grad":
        w = model.model.layers[0].mlp.down_proj.weight
        w.register_hook(lambda g: g * float("nan") if trainer.step_num == step else g)
    else:
        model.model.norm.register_forward_hook(
            lambda m, a, out: out * float("nan") if m.training and trainer.step_num == step else out)


def run_trainer(out_dir: str, stage: int):
    """ZeRO-2: gradient poison at step 1, a checkpoint every step, then a second Trainer resumed
    from step 2 runs step 3 (exact resume). ZeRO-3: hidden-state poison at step 1, gradient
    poison at step 2, β > 0 (reference model), K = 2 (old log-probs through the engine)."""
    from fastgrpo.runs import checkpoint as ckpt

    run = os.path.join(out_dir, f"trainer{stage}")
    extra = ["checkpoint.every=1", "checkpoint.keep_last=2"] if stage == 2 else \
        ["algorithm.beta=0.04", "algorithm.inner_steps=2"]
    trainer = make_trainer(trainer_cfg(run, stage, *extra))
    w0 = flat_weights(trainer.backend)
    if stage == 2:
        poison(trainer, "grad", step=1)
    else:  # both kinds: a NaN gradient is found in ZeRO-3's partitions too
        poison(trainer, "hidden", step=1)
        poison(trainer, "grad", step=2)
    trainer.train()
    rec = {"w0": w0, "w": flat_weights(trainer.backend), "steps": trainer.backend.engine.global_steps,
           "nan_skips": trainer.nan_skips, "seqs": trainer.seqs_per_step,
           "curriculum": trainer.curriculum.state_dict()["curriculum"],
           "fast_linears": sum(type(m).__name__ == "FastLinear" for m in trainer.backend.module.modules()),
           "fused_layers": sum(type(m).__name__.startswith("Fused") and type(m).__name__.endswith("DecoderLayer")
                               for m in trainer.backend.module.modules())}
    if trainer.ref_model is not None:
        rec["ref"] = torch.cat([v.flatten().float() for _, v in sorted(trainer.ref_model.state_dict().items())])
    if stage == 2:
        step2 = [p for p in ckpt.list_checkpoints(run) if p.endswith("step-00000002")]
        resumed = make_trainer(trainer_cfg(run + "-resumed", stage, f"checkpoint.resume={step2[0]}"))
        resumed.maybe_resume()
        resumed.train()
        rec["w_resumed"] = flat_weights(resumed.backend)
        rec["resumed_from"] = step2[0]
    return trainer.backend, rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="deepspeed:2:adamw",
                    help="comma-separated backend:zero_stage:optimizer, trained one after the other")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reference-ranks", type=int, default=0,
                    help="replay N ranks' rollouts in one process, once per optimizer named in --configs")
    a = ap.parse_args()
    torch.set_num_threads(1)
    configs = [c.split(":") for c in a.configs.split(",")]
    if a.reference_ranks:
        for opt_name in sorted({c[2] for c in configs}):
            model, opt = build(opt_name)
            backend = DistributedBackend(model, opt, backend="none", max_grad_norm=1.0)
            train(backend, a.steps, list(range(a.reference_ranks)))
            torch.save(flat_weights(backend), os.path.join(a.out, f"reference_{opt_name}.pt"))
        return 0
    for kind, stage, opt_name in configs:
        if kind == "trainer":
            backend, rec = run_trainer(a.out, int(stage))
            torch.save(rec, os.path.join(a.out, f"{kind}_{stage}_{opt_name}_rank{backend.rank}.pt"))
            continue
        model, opt = build(opt_name)
        backend = DistributedBackend(model, opt, backend=kind, zero_stage=int(stage), max_grad_norm=1.0)
        n_micro = train(backend, a.steps, [backend.rank])
        torch.save({"w": flat_weights(backend), "micro": n_micro},
                   os.path.join(a.out, f"{kind}_{stage}_{opt_name}_rank{backend.rank}.pt"))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
