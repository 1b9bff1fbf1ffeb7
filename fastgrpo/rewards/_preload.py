"""Imported once by the fork server (RewardPool preload): loads Math-Verify, SymPy and the
LaTeX grammar and runs one parse/verify, so every forked worker starts warm (the first LaTeX
parse in a cold process costs ~0.3 s; a forked one inherits the loaded parser for free)."""
from math_verify import parse, verify

import fastgrpo.rewards.math  # noqa: F401  (worker task functions)
import fastgrpo.rewards.sandbox.runner  # noqa: F401

verify(parse("$\\frac{1}{2}$"), parse("$0.5$"))
