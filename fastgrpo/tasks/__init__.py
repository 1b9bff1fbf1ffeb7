"""fastgrpo.tasks: a task is data + prompt formatting + the rewards it defines.

`base` states the protocol; `arithmetic` is the embedded demo task; `jsonl` reads a user's
prompt / answer file. `build_task(DataConfig)` (fastgrpo.tasks.base) picks one from the config.
"""
