"""hpctrain: a Slurm-native job suite for training large transformer models."""

__version__ = "0.1.0"
