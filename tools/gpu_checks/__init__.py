"""The parts of tools/gpu_check.py: what a check gets and gives back and the helpers every check uses (common),
the checks a-e (checks, bitwise_resume), the first block (command, control, llama_hf), the checks since MoE (moe,
context, offload, fp8_tp, engine_checks, tp_norm, restart; their probes: op logs, host-sync counters), and the
forked, time-limited run of one check (runner)."""
