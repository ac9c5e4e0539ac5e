"""Benchmarks of the training step: `moefold bench` (run.py), its profile breakdown (profile.py),
the step limit of its large kernels timed alone (limit.py) and device timing helpers (timing.py).

docs/benchmarks.md says how to run them and records the results.
"""
