"""fastgrpo.tasks: a task is data + prompt formatting + the rewards it defines.

`base` states the protocol (`Problem`, `Task`); `loaders` reads rows (jsonl / json / parquet /
csv, `datasets` folders, hub ids); `formatting` builds prompt text (chat template, system prompt,
few-shot); `math` and `code` are the task kinds; `build.build_task(DataConfig, tokenizer, …)`
picks and checks one from the config; `arithmetic` is the embedded demo's task; `jsonl` the
older name of a math task.
"""
