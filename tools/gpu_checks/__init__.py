"""The parts of tools/gpu_check.py: what a check gets and gives back and the helpers every check uses (common),
the checks a-e (checks, bitwise_resume), and the forked, time-limited run of one check (runner)."""
