"""Run configuration: one dataclass per concern, loaded from YAML with `--set a.b=value` overrides.

Follows the house style (shared/DESIGN.md rule 5): every field carries an inline comment, YAML
maps onto the dataclasses one key per field, and an unknown key or an invalid value fails at load
time with the dotted field name (`algorithm.eps_low=-1: expected ...`). The defaults suit a
pretrained model (RL learning rates, no SFT unless asked, the task's accuracy reward); the
embedded demo (`fastgrpo train` with no arguments, fastgrpo/demo/default.py) sets its own values
for its tiny from-scratch model. `AlgorithmConfig.loss_config()` maps the loss fields onto the
kernels' `LossConfig`, which validates them once more.

Split in two: `schema.py` (the dataclasses) and `load.py` (loading and checks); this package
exports the public names of both, so `from fastgrpo.config import TrainConfig, load_config` holds.
"""
from fastgrpo.config.load import apply_overrides, dump_config, load_config, parse_override, to_dict, validate
from fastgrpo.config.schema import *  # noqa: F401,F403 (every section's dataclass, REWARD_NAMES, check_reward_name)
from fastgrpo.config.schema import REWARD_NAMES, check_reward_name  # noqa: F401 (named: not in a star's reach of linters)
