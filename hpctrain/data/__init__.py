"""Token sources and the deterministic global-index sampler."""
