"""fastgrpo.logs: what a run shows.

`metrics` (metrics.jsonl, timers, the TensorBoard / plots writer, the logger a trainer holds),
`samples` (samples.jsonl: what the model wrote, turn by turn for episodes), `jsonl` (torn-line
safe JSON lines), `wandb_logger` (Weights & Biases), `console` (the progress bar and the one-line
messages). What a step computes about its rollouts (and reduces over ranks) is the trainer's:
`fastgrpo.trainer.step_metrics`.
"""
