"""Shared pieces of the tests that call TRL 1.16's real `GRPOTrainer._compute_loss` on a minimal
stand-in trainer object: the batch geometry and a single-process accelerator."""
from contextlib import nullcontext

B, P, C = 4, 5, 7  # sequences, prompt length, completion length
TAU = 0.8
GA, SPG = 2, 4  # gradient accumulation steps, steps per generation


class StandInAccelerator:
    """The accelerate.Accelerator surface `_compute_loss` touches, for one process."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True

    def autocast(self):
        return nullcontext()

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def padded_batch(model):
    """TRL's padded GRPO batch on `model` (float64): left-padded prompts, completions of lengths
    [C, 3, 0, 5] (row 2 fully masked), old / ref policies near the current one so ratios straddle
    1 ± ε and δ, and vLLM importance weights around 1. Returns (inputs, lengths)."""
    import torch

    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    prompt_ids = torch.randint(3, v, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    completion_ids = torch.randint(3, v, (B, C), generator=g)
    lengths = torch.tensor([C, 3, 0, 5])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1),
                       attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
        logp = torch.log_softmax(logits[:, P - 1:-1] / TAU, -1).gather(-1, completion_ids[..., None])[..., 0]
    inputs = dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64),
        old_per_token_logps=logp + 0.5 * torch.randn(B, C, generator=g, dtype=torch.float64),
        ref_per_token_logps=logp + 0.3 * torch.randn(B, C, generator=g, dtype=torch.float64),
        importance_sampling_ratio=0.6 + 0.8 * torch.rand(B, C, generator=g, dtype=torch.float64),
        num_items_in_batch=torch.tensor(float(completion_mask.sum() * 3)),
    )
    return inputs, lengths
