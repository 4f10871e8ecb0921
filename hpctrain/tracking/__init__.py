"""Metrics out of the loop: JSONL always, Weights & Biases when configured."""
