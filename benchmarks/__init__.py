"""fastgrpo benchmarks: one script per measured thing, sharing harness.py."""
