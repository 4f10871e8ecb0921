"""The GPT family (GPT-2/3, model.arch=gpt): its family entry (entry.py, torch-free) and its torch module
(model.py: the module, its builder, its Hugging Face tensor table)."""
