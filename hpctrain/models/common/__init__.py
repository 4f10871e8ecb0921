"""What the families share, and no family owns: the attention core context parallelism replaces (attention.py),
the Mixture-of-Experts layer (moe.py) and what an MoE family entry is made of (moe_entry.py, torch-free), the
host reads a recomputation replays (host_reads.py), the weights' initialisation by name (init.py) and the pieces
of the Hugging Face tensor tables (recipes.py). Nothing here names a family."""
