"""The training loop that runs on every task."""
