"""Layouts applied to a model from outside: DDP, ZeRO/FSDP2, TP, PP, and the engine that steps them."""
