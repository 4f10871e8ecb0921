"""The Mixtral family (model.arch=mixtral): its family entry (entry.py, torch-free) and its torch module (model.py:
Llama's with a Mixture-of-Experts feed-forward, which Qwen3-MoE reuses, its builder, its Hugging Face tensor
table)."""
