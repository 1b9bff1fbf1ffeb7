"""fastgrpo.workers: the asynchronous schedule (rollout.mode=async) — rollout workers on Ray.

- cluster.py: start a local Ray sized from the config, or join `cluster.address`
- rollout_worker.py: the `ray::RolloutWorker` actor (one engine, staged weights, versioned groups)
- pool.py: the actors from trainer rank 0 (start, broadcast group, verified broadcast, restarts)
- orchestrator.py: admission by staleness η, the version-tagged buffer, faults, checkpoint state
"""
