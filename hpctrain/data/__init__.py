"""Data: token sources, Megatron-format indexed datasets (read, write, prepare from a corpus), packing and
blending, the global-index sampler, and the read-ahead batch reader."""
