"""The Llama family (Llama 2/3, model.arch=llama): its family entry (entry.py, torch-free) and its torch module
(model.py: the module Qwen3 and the Mixture-of-Experts families build on, its builder, its Hugging Face tensor
table)."""
