"""Config schema (Hydra structured configs), layout resolution and the checks run before submission."""
