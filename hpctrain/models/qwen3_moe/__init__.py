"""The Qwen3-MoE family (model.arch=qwen3_moe): its family entry (entry.py, torch-free) and its torch module
(model.py: Mixtral's with Qwen3's per-head query/key norms, its builder, its Hugging Face tensor table)."""
