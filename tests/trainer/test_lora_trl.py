"""The TRL drop-in with a LoRA policy (issue 24): `FastGRPOTrainer(..., peft_config=LoraConfig)`
keeps fastgrpo's fused loss (no fallback to TRL's), trains the adapter and leaves the base."""
import pytest

pytest.importorskip("trl")


def test_fast_trainer_with_peft_config_keeps_the_fused_loss(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig

    from fastgrpo.integrations.trl import FastGRPOTrainer
    from fastgrpo.models.tiny import build_tiny_model

    model, tok = build_tiny_model("qwen2", seed=0)
    prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]})

    def digits(completions, **kw):  # varied rewards, so advantages ≠ 0
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, max_completion_length=6, num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2,
                      learning_rate=5e-2, loss_type="dapo", beta=0.0, report_to="none", logging_steps=1,
                      save_strategy="no", temperature=1.0, use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    trainer = FastGRPOTrainer(model=model, reward_funcs=digits, args=args, train_dataset=prompts,
                              processing_class=tok,
                              peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    named = dict(trainer.model.named_parameters())
    assert any(".lora_A." in n for n in named)
    before = {n: p.detach().clone() for n, p in named.items()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer._fastgrpo_calls >= 2 and trainer._fastgrpo_fallbacks == 0  # every loss was fastgrpo's
    moved = {n for n, p in trainer.model.named_parameters() if not (p.detach() == before[n]).all()}
    assert moved and all(".lora_" in n for n in moved), f"a base weight moved: {sorted(moved)[:3]}"
