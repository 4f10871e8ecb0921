"""Distributed checkpoints (DCP): save, commit, retain, resume."""
