"""fastgrpo.episodes: what a multi-turn, tool-using episode talks to, and its record.

- `tools`: a tool is a typed Python function; its signature and docstring become its JSON schema
  (`tool_schema`), `load_tool` resolves `rollout.tools` specs (`module:function`,
  `path/to/file.py:function`, or a built-in name).
- `builtin`: the built-in tools, `calculator` (safe arithmetic) and `python` (the code sandbox of
  rewards/sandbox).
- `calls`: tool calls parsed out of a turn's text (`<tool_call>` JSON), tool results and the
  system-prompt fallback for chat templates without `tools=` support.
- `executor`: runs tool calls out of process, each in its own process group, with a wall-clock
  limit, an output cap and per-episode / global parallelism limits; `toolproc`: its worker side
  (fork per call, bounded reads, group kill, subreaper sweep).
- `env`: user environments (`rollout.env: module:Class`, reset / step), each instance in its own
  process; `env_adapters`: TRL's `environment_factory` shape and verifiers' `MultiTurnEnv`.
- `ledger` (written separately): the append-only episode ledger and its one mask.

Importing the package is cheap: no torch, no transformers; each module imports what it needs.
"""
