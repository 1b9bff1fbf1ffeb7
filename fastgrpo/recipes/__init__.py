"""fastgrpo.recipes: the stages around GRPO, built from the trainer's parts.

`stages` (SFT cold start → RLVR → the reward-model stage, as DeepSeek-R1 / Qwen3 chain them),
`fusion` (Qwen3's thinking-mode fusion: one model, /think and /no_think), `budget_sweep`
(accuracy against the thinking budget). Each stage builds its own rewards once.
"""
