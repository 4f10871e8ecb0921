"""The Qwen3 family (dense Qwen3, model.arch=qwen3): its family entry (entry.py, torch-free) and its torch module
(model.py: Llama's with per-head query/key norms, its builder, its Hugging Face tensor table)."""
