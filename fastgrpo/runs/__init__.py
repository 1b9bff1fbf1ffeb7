"""fastgrpo.runs: the run folder — where a run lives and how it comes back.

`folder` (the folder's layout, its private temp dir, signals that stop a run with a checkpoint),
`lock` (one writer per run folder, stale locks taken over), `record` (the run's record:
config, versions, what it saved), `checkpoint` / `checkpoint_load` (atomic save with checksums,
verify, load). The trainer's side of saving and resuming (which state goes in, collectives
around it) is `fastgrpo.trainer.resume`; this room knows nothing of training.
"""
