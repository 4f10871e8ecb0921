"""The dry-run plan: what would run, where, and with what, before anything is queued.

`build_plan` gathers plain data (JSON-ready); `render_text` prints it for a person. Estimates from the
planner modules join as further sections of the same dict.
"""

from __future__ import annotations

import json
from typing import Any

from hpctrain.config.checks import CheckReport
from hpctrain.config.schema import Executor
from hpctrain.distributed.task_env import task_environment
from hpctrain.launch.executor import sbatch_preview
from hpctrain.launch.rundir import RunDir
from hpctrain.models.params import padded_vocab, param_count
from hpctrain.plan.estimate import as_json, table_lines


def model_params(cfg: Any) -> int:
    """The model's own parameter count, with the tokenizer's vocabulary (what papers publish: GPT-3 175B)."""
    m = cfg.model
    return param_count(m.n_layers, m.d_model, m.vocab_size, m.context, m.ffn_mult * m.d_model)


def vocab_padding(cfg: Any, tp: int) -> dict[str, int]:
    """The embedding as built (hpctrain.models.gpt: padded_vocab rows, tied head): rows and parameters it adds."""
    m = cfg.model
    rows = padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp)
    return {"vocab_size": m.vocab_size, "embedding_rows": rows, "multiple": m.vocab_pad_multiple, "tp": tp,
            "extra_rows": rows - m.vocab_size, "extra_params": (rows - m.vocab_size) * m.d_model}


def build_plan(cfg: Any, report: CheckReport, run: RunDir) -> dict[str, Any]:
    lay = report.layout
    m = cfg.model
    plan: dict[str, Any] = {
        "run": {"name": cfg.run.name, "id": run.run_id, "directory": str(run.path), "resumed": run.resumed},
        "params_total": model_params(cfg),
        "vocab_padding": vocab_padding(cfg, lay.tp),
        "model": {"name": m.name, "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                  "vocab_size": m.vocab_size, "context": m.context},
        "world_size": lay.world_size,
        "layout": {"nodes": lay.nodes, "gpus_per_node": lay.gpus_per_node, "dp": lay.dp, "tp": lay.tp,
                   "pp": lay.pp, "dp_replicate": lay.dp_replicate, "virtual_stages": lay.virtual_stages,
                   "schedule": cfg.parallel.schedule, "sequence_parallel": cfg.parallel.sequence_parallel,
                   "zero_stage": lay.zero_stage, "offload_optimizer": cfg.zero.offload_optimizer,
                   "offload_params": cfg.zero.offload_params, "micro_batch": lay.micro_batch,
                   "grad_accum": lay.grad_accum, "global_batch": lay.global_batch,
                   "tokens_per_step": lay.global_batch * cfg.train.seq_len},
        "precision": cfg.precision.dtype.value,
        "executor": cfg.cluster.executor.value,
        "environment": task_environment(cfg),
        "warnings": [{"key": w.key, "message": w.message, "fix": w.fix} for w in report.warnings],
    }
    if lay.pp > 1 or lay.tp > 1:
        plan["sections"] = [_stage_section(cfg, lay, plan)]
    if report.estimates is not None:
        plan.update(as_json(report.estimates))
        plan.setdefault("sections", []).append({"title": "estimates", "lines": table_lines(report.estimates)})
        if cfg.plan.search > 0:
            from hpctrain.plan.auto import search_section

            section = search_section(cfg, report.estimates, cfg.plan.search)
            plan["layout_search"] = section.pop("json")
            plan["sections"].append(section)
    if cfg.cluster.executor == Executor.slurm:
        plan["sbatch"] = sbatch_preview(cfg, lay, run.run_id, run.submitit_folder)
    return plan


def _stage_section(cfg: Any, lay: Any, plan: dict[str, Any]) -> dict[str, Any]:
    """Parameters per pipeline stage and per GPU after the TP split, from the model built on the meta device."""
    from hpctrain.parallel.stages import param_counts, stage_ids

    stages, ranks = param_counts(cfg, lay)
    plan["params_per_stage"], plan["params_per_gpu_before_zero"] = stages, ranks
    lines = [f"model built on the meta device per rank layout: {len(stages)} stages, TP {lay.tp}"]
    for r, count in enumerate(ranks):
        mine = stage_ids(r, lay.pp, lay.virtual_stages, cfg.parallel.schedule)
        lines.append(f"  pipeline rank {r}: stage(s) {','.join(map(str, mine))} "
                     f"{sum(stages[s] for s in mine):>16,} params, {count:>15,} per GPU after TP")
    return {"title": "stages", "lines": lines}


def render_text(plan: dict[str, Any]) -> str:
    lay, m = plan["layout"], plan["model"]
    out = [
        f"hpctrain plan: {plan['run']['name']} (run id {plan['run']['id']}, not submitted)",
        f"  run directory   {plan['run']['directory']}",
        f"  model           {m['name']}: {m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, "
        f"vocab {m['vocab_size']}, context {m['context']}",
        f"  parameters      {plan['params_total']:,} ({_human(plan['params_total'])})",
        *_padding_lines(plan),
        f"  cluster         {lay['nodes']} nodes x {lay['gpus_per_node']} GPUs = {plan['world_size']} "
        f"({plan['executor']} executor)",
        f"  layout          DP {lay['dp']} x TP {lay['tp']} x PP {lay['pp']}"
        + (f" (HSDP: {lay['dp_replicate']} replicas)" if lay["dp_replicate"] > 1 else "")
        + (f", {lay['virtual_stages']} virtual stages" if lay["virtual_stages"] > 1 else "")
        + (f", schedule {lay['schedule']}" if lay["pp"] > 1 else "")
        + (", sequence parallel" if lay["sequence_parallel"] else ""),
        f"  ZeRO            stage {lay['zero_stage']}"
        + (", optimizer offload" if lay["offload_optimizer"] else "")
        + (", parameter offload" if lay["offload_params"] else ""),
        f"  batch           global {lay['global_batch']} = micro-batch {lay['micro_batch']} x grad accum "
        f"{lay['grad_accum']} x DP {lay['dp']} ({lay['tokens_per_step']:,} tokens/step)",
        f"  precision       {plan['precision']}",
    ]
    for section in plan.get("sections", []):
        out.append("")
        out.extend(section["lines"])
    out.append("")
    out.append("task environment")
    out.extend(f"  {k}={v}" for k, v in plan["environment"].items())
    if plan["warnings"]:
        out.append("")
        out.append(f"warnings ({len(plan['warnings'])})")
        for w in plan["warnings"]:
            out.append(f"  - {w['key']}: {w['message']}")
            out.append(f"      fix: {w['fix']}")
    if "sbatch" in plan:
        out.append("")
        out.append("sbatch script (as submitit would write it)")
        out.append(plan["sbatch"].rstrip())
    return "\n".join(out)


def _padding_lines(plan: dict[str, Any]) -> list[str]:
    """The vocabulary padding, apart from the model's own parameter count (none when nothing is padded)."""
    pad = plan.get("vocab_padding")
    if not pad or not pad["extra_rows"]:
        return []
    built = plan["params_total"] + pad["extra_params"]
    return [f"  vocab padding   embedding padded {pad['vocab_size']} -> {pad['embedding_rows']} rows (multiple of "
            f"{pad['multiple']} x TP {pad['tp']}): +{pad['extra_params']:,} params, {built:,} as built"]


def render(plan: dict[str, Any], fmt: str) -> str:
    return json.dumps(plan, indent=1) if fmt == "json" else render_text(plan)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)

