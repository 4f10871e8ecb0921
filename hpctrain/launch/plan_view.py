"""The dry-run plan on the login node: what would run, where, and with what, before anything is queued.

`build_plan` gathers the planner's data (hpctrain.plan: pure), the run, the task environment, the checks'
warnings and errors, and the batch script (rendered by the run's backend as it submits it) into one JSON-ready
dict; `render` prints it as text or JSON. A launched run stores the same dict as plan.json.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from hpctrain.checks.report import CheckReport
from hpctrain.distributed.task_env import task_environment
from hpctrain.goodput.expected import describe, run_goodput
from hpctrain.launch.executor import sbatch_preview
from hpctrain.launch.plan_tables import memory_lines, search_lines, stage_lines, step_lines
from hpctrain.launch.rundir import RunDir
from hpctrain.launch.secrets import redacted_keys
from hpctrain.plan.auto import auto_candidates, search_summary
from hpctrain.plan.estimate import Estimates, as_json
from hpctrain.plan.report import active_params, model_params, model_summary, stage_counts, vocab_padding
from hpctrain.plan.search import evaluate

if TYPE_CHECKING:
    from hpctrain.config.layout import Layout
    from hpctrain.config.schema import Config, ParallelConfig, ZeroConfig


def build_plan(cfg: Config, report: CheckReport, run: RunDir) -> dict[str, Any]:
    """The whole plan; with errors in the report, as much of it as the config allows (and the errors)."""
    lay = report.layout
    plan: dict[str, Any] = {
        "run": {"name": cfg.run.name, "id": run.run_id, "directory": str(run.path), "resumed": run.resumed},
        "params_total": model_params(cfg.model),
        "vocab_padding": vocab_padding(cfg.model, lay.tp),
        "model": model_summary(cfg.model),
        "world_size": lay.world_size,
        "layout": layout_summary(lay, cfg.parallel, cfg.zero, cfg.train.seq_len),
        "precision": cfg.precision.dtype.value,
        "executor": cfg.cluster.executor.value,
        "recovery": recovery_summary(cfg),
        "environment": task_environment(cfg),
        "redacted": redacted_keys(cfg.cluster),
        "warnings": [{"key": w.key, "message": w.message, "fix": w.fix} for w in report.warnings],
    }
    active = active_params(cfg.model)
    if active is not None:  # a Mixture of Experts: the parameters a token goes through
        plan["params_active"] = active
    if report.errors:
        plan["errors"] = [{"key": e.key, "message": e.message, "fix": e.fix} for e in report.errors]
    sections = []
    counts = stage_counts(cfg.model, lay) if max(lay.pp, lay.tp, lay.ep) > 1 else None
    if counts is not None:
        plan.update(counts)
        sections.append({"title": "stages", "lines": stage_lines(counts, lay.tp, lay.ep)})
    est = report.estimates
    if est is not None:
        plan.update(as_json(est))
        plan["expected_goodput"] = run_goodput(cfg, plan["params_total"], est.step.step_time_s)
        sections.append({"title": "estimates", "lines": memory_lines(est) + [""] + step_lines(est)})
        if cfg.plan.search > 0:
            plan["layout_search"], lines = _search(cfg, est, cfg.plan.search)
            sections.append({"title": "layout search", "lines": lines})
    if sections:
        plan["sections"] = sections
    script = sbatch_preview(cfg, lay, run.run_id, run.submitit_folder)
    if script is not None:
        plan["batch_script"] = script
    return plan


# What the plan says of each credential taken out of cluster.env (hpctrain.launch.secrets)
REDACTION = (
    "passed to the job through the environment of the submission, not written to the plan, config.yaml or plan.json"
)


def recovery_summary(cfg: Config) -> str:
    """How a failure is recovered: inside the allocation (agents, spares, shrinking) or by resubmission; with
    replica groups (recovery.mode), one group at a time while the others train on."""
    launcher, restarts = cfg.launcher, cfg.launcher.max_restarts
    if not launcher.in_allocation:
        return f"one task per rank; a failed job is resubmitted without its bad nodes (up to {restarts} times)"
    parts = [f"1 agent per node restarts failed ranks in the allocation (up to {restarts} times)"]
    rec = cfg.recovery
    if rec.mode in ("replicas", "diloco"):
        sync = "every step (torchft)" if rec.mode == "replicas" else f"every {rec.sync_every} steps (DiLoCo, torchft)"
        parts.insert(
            0,
            f"recovery={rec.mode}: {rec.groups} replica groups synced {sync}; a failed group is left out while the "
            "others train on, and rejoins healed from a live peer",
        )
    if cfg.cluster.spare_nodes:
        parts.append(f"{cfg.cluster.spare_nodes} hot spare node(s) replace dead ones")
    if cfg.elastic.min_nodes:
        parts.append(f"shrinks to {cfg.elastic.min_nodes} node(s) at least, same global batch")
    return "; ".join(parts)


def _groups(lay: dict[str, Any]) -> str:
    """ "2 replica groups x " before a group's figures (recovery=replicas|diloco); nothing without groups."""
    return f"{lay['replicas']} replica groups x " if lay.get("replicas", 1) > 1 else ""


def layout_summary(lay: Layout, parallel: ParallelConfig, zero: ZeroConfig, seq_len: int) -> dict[str, Any]:
    return {
        "nodes": lay.nodes,
        "gpus_per_node": lay.gpus_per_node,
        "dp": lay.dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "ep": lay.ep,
        "cp": lay.cp,
        "dp_replicate": lay.dp_replicate,
        "replicas": lay.replicas,
        "virtual_stages": lay.virtual_stages,
        "first_stage_layers": lay.first_stage_layers,
        "last_stage_layers": lay.last_stage_layers,
        "schedule": parallel.schedule,
        "sequence_parallel": parallel.sequence_parallel,
        "zero_stage": lay.zero_stage,
        "offload_optimizer": zero.offload_optimizer,
        "offload_params": zero.offload_params,
        "offload_optimizer_device": lay.offload_device,
        "accumulate_unsharded": lay.accumulate_unsharded,
        "micro_batch": lay.micro_batch,
        "grad_accum": lay.grad_accum,
        "global_batch": lay.global_batch,
        "tokens_per_step": lay.global_batch * seq_len,
    }


def _search(cfg: Config, est: Estimates, top_k: int) -> tuple[dict[str, Any], list[str]]:
    """The layout search's data and its text lines: the top layouts (those `parallel=auto` would choose from: the
    run's precision, FP8, compile and offload settings), and where the configured one ranks."""
    cluster = cfg.cluster
    n_gpus = cluster.nodes * cluster.gpus_per_node
    candidates = auto_candidates(cfg)
    mine = evaluate(est.model, est.layout, est.hw)
    data = search_summary(candidates, mine, top_k)
    return data, search_lines(candidates, mine, data["configured_rank"], top_k, f"{n_gpus} x {cluster.gpu_type}")


def render_text(plan: dict[str, Any]) -> str:
    lay, m = plan["layout"], plan["model"]
    out = [
        f"hpctrain plan: {plan['run']['name']} (run id {plan['run']['id']}, not submitted)",
        f"  run directory   {plan['run']['directory']}",
        f"  model           {m['name']} ({m['arch']}): {m['n_layers']} layers, d_model {m['d_model']}, "
        f"{m['n_heads']} heads"
        + (f" ({m['n_kv_heads']} key/value)" if m["n_kv_heads"] != m["n_heads"] else "")
        + (_experts(m["moe"]) if "moe" in m else f", MLP {m['ffn_hidden']}")
        + f", vocab {m['vocab_size']}, context {m['context']}",
        f"  parameters      {plan['params_total']:,} ({_human(plan['params_total'])})"
        + (
            f", {plan['params_active']:,} ({_human(plan['params_active'])}) active per token (top_k of each "
            "layer's experts)"
            if "params_active" in plan
            else ""
        ),
        *_padding_lines(plan),
        f"  cluster         {_groups(lay)}{lay['nodes']} nodes x {lay['gpus_per_node']} GPUs = "
        f"{plan['world_size'] * lay.get('replicas', 1)} ({plan['executor']} executor)",
        f"  recovery        {plan['recovery']}",
        *_goodput_lines(plan),
        f"  layout          DP {lay['dp']} x TP {lay['tp']} x PP {lay['pp']}"
        + (f" x CP {lay['cp']} (each sequence split over {lay['cp']} GPUs)" if lay.get("cp", 1) > 1 else "")
        + (f" (HSDP: {lay['dp_replicate']} replicas)" if lay["dp_replicate"] > 1 else "")
        + (f", EP {lay['ep']} (experts split over {lay['ep']} of the DP ranks)" if lay.get("ep", 1) > 1 else "")
        + (f", {lay['virtual_stages']} virtual stages" if lay["virtual_stages"] > 1 else "")
        + (
            f", first/last stage {lay['first_stage_layers'] or 'as the others'} / "
            f"{lay['last_stage_layers'] or 'as the others'} layers"
            if lay.get("first_stage_layers") or lay.get("last_stage_layers")
            else ""
        )
        + (f", schedule {lay['schedule']}" if lay["pp"] > 1 else "")
        + (", sequence parallel" if lay["sequence_parallel"] else ""),
        f"  ZeRO            stage {lay['zero_stage']}"
        + (", optimizer offload" if lay["offload_optimizer"] else "")
        + (
            " (Adam's moments on NVMe)"
            if lay["offload_optimizer"] and lay.get("offload_optimizer_device") == "nvme"
            else ""
        )
        + (", parameter offload" if lay["offload_params"] else "")
        + (
            ", gradients accumulated unsharded, one reduce-scatter a step (zero.accumulate_unsharded)"
            if lay.get("accumulate_unsharded")
            else ""
        ),
        f"  batch           global {lay['global_batch'] * lay.get('replicas', 1)} = {_groups(lay)}micro-batch "
        f"{lay['micro_batch']} x grad accum {lay['grad_accum']} x DP {lay['dp']} "
        f"({lay['tokens_per_step'] * lay.get('replicas', 1):,} tokens/step)",
        f"  precision       {plan['precision']}",
    ]
    for section in plan.get("sections", []):
        out += ["", *section["lines"]]
    out += ["", "task environment", *(f"  {k}={v}" for k, v in plan["environment"].items())]
    out += [f"  {key}: redacted ({REDACTION})" for key in plan.get("redacted", [])]
    out += _problem_lines("warnings", plan["warnings"])
    if "batch_script" in plan:
        out += ["", f"batch script ({plan['executor']}, as submitit would write it)", plan["batch_script"].rstrip()]
    return "\n".join(out)


def _experts(moe: dict[str, int]) -> str:
    """A Mixture of Experts' feed-forward in the model line."""
    shared = f" + {moe['n_shared_experts']} shared" if moe["n_shared_experts"] else ""
    return f", MoE: {moe['n_experts']} experts of {moe['expert_hidden']}{shared}, top {moe['top_k']} per token"


def _problem_lines(title: str, problems: list[dict[str, str]]) -> list[str]:
    if not problems:
        return []
    out = ["", f"{title} ({len(problems)})"]
    for p in problems:
        out += [f"  - {p['key']}: {p['message']}", f"      fix: {p['fix']}"]
    return out


def _goodput_lines(plan: dict[str, Any]) -> list[str]:
    """The expected goodput in the run's recovery mode (none without the planner's step time)."""
    expected = plan.get("expected_goodput")
    return [f"  goodput         {describe(expected)}"] if expected else []


def _padding_lines(plan: dict[str, Any]) -> list[str]:
    """The vocabulary padding, apart from the model's own parameter count (none when nothing is padded)."""
    pad = plan.get("vocab_padding")
    if not pad or not pad["extra_rows"]:
        return []
    built = plan["params_total"] + pad["extra_params"]
    return [
        f"  vocab padding   embedding padded {pad['vocab_size']} -> {pad['embedding_rows']} rows (multiple of "
        f"{pad['multiple']} x TP {pad['tp']}): +{pad['extra_params']:,} params, {built:,} as built"
    ]


def render(plan: dict[str, Any], fmt: str) -> str:
    return json.dumps(plan, indent=1) if fmt == "json" else render_text(plan)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
