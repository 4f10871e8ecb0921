"""The checks of where and how the job runs: the cluster, the local machine's GPUs, timeouts, and the string
values that end up in the sbatch script."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Any

from omegaconf import OmegaConf

from hpctrain.checks.container import container_checks, run_dir_parts
from hpctrain.checks.report import CheckReport
from hpctrain.config.layout import Layout, layouts_on_nodes
from hpctrain.config.problems import ConfigError
from hpctrain.config.schema import RECOVERY_MODES, TIMEOUT_MARGIN_S, Config
from hpctrain.scheduler import scheduler_for


def visible_gpus(environ: dict[str, str], driver: str = "/proc/driver/nvidia/gpus", dev: str = "/dev") -> int:
    """GPUs this machine lets a process use, without importing torch: the NVIDIA driver's device list (or,
    in containers without it, the /dev/nvidiaN device nodes), narrowed by CUDA_VISIBLE_DEVICES when set."""
    if os.path.isdir(driver):
        present = len(os.listdir(driver))
    else:
        present = sum(
            1 for n in (os.listdir(dev) if os.path.isdir(dev) else []) if n[6:].isdigit() and n.startswith("nvidia")
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([d for d in visible.split(",") if d.strip() not in ("", "-1")]))


def _local_gpus(gpu_type: str, per_node: int, visible: int, r: CheckReport) -> None:
    """Tasks that run on this machine get a GPU each only when gpu_type names one; say so when GPUs sit idle."""
    if gpu_type != "cpu" and visible < per_node:
        r.error(
            "cluster.gpus_per_node",
            f"cluster.gpu_type={gpu_type} runs one task per GPU, {per_node} tasks, "
            f"but this machine shows {visible} GPU(s)",
            f"set cluster.gpus_per_node={max(visible, 1)}" + ("" if visible else " and cluster.gpu_type=cpu"),
        )
    elif gpu_type == "cpu" and visible:
        r.warn(
            "cluster.gpu_type",
            f"this machine has {visible} GPU(s) but cluster.gpu_type=cpu: the tasks train on the CPU",
            f"set cluster.gpu_type to the GPU's type (e.g. h100) and cluster.gpus_per_node={visible}",
        )


def _control_characters(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """String values end up in the sbatch script (one #SBATCH line each) and in paths: a newline in
    cluster.partition would start a line of its own. cluster.setup lines are shell lines by design."""

    def walk(node: Any, key: str) -> None:
        if key == "cluster.setup":
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(str(k), f"{key}.{k}" if key else str(k))  # keys become #SBATCH options and variables too
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")
        elif isinstance(node, str) and any(ord(ch) < 32 or ord(ch) == 127 for ch in node):
            r.error(
                key,
                f"{node!r} holds a control character (a newline or tab would end up in the sbatch script or a path)",
                f"remove it from {key}",
            )

    walk(OmegaConf.to_container(cfg, resolve=False), "")


def _cluster(cfg: Config, lay: Layout, r: CheckReport) -> None:
    c = cfg.cluster
    backend = scheduler_for(c.executor)
    can = backend.capabilities
    if not can.multi_node and c.nodes != 1:
        r.error(
            "cluster.nodes",
            f"the {backend.name} executor runs on one machine, got nodes={c.nodes}",
            "set cluster.nodes=1, or submit to Slurm with cluster=slurm (or cluster=dev)",
        )
    if can.runs_here:
        _local_gpus(c.gpu_type, c.gpus_per_node, visible_gpus(dict(os.environ)), r)
    if c.cpus_per_task < 1:
        r.error("cluster.cpus_per_task", f"must be >= 1, got {c.cpus_per_task}", "set cluster.cpus_per_task=1")
    if c.signal_delay_s < 0:
        r.error(
            "cluster.signal_delay_s",
            f"must be >= 0 seconds, got {c.signal_delay_s}: Slurm's warning signal "
            "(--signal=USR2@N) comes N seconds before the time limit",
            "use cluster.signal_delay_s=120",
        )
    if c.time_min < 1:
        r.error("cluster.time_min", f"must be >= 1 minute, got {c.time_min}", "set cluster.time_min=60")
    elif c.signal_delay_s >= c.time_min * 60:
        r.error(
            "cluster.signal_delay_s",
            f"the warning signal {c.signal_delay_s} s before the end would come before "
            f"the job starts (time limit {c.time_min} min)",
            f"use cluster.signal_delay_s<={c.time_min * 60 // 4}",
        )
    elif can.warning_signal and 0 <= c.signal_delay_s < 30:
        r.warn(
            "cluster.signal_delay_s",
            f"{c.signal_delay_s} s may be too short to finish a step and save",
            "allow a step plus a fast-tier save, e.g. cluster.signal_delay_s=120",
        )
    if can.requeue and c.requeue and c.time_min <= 10:
        r.warn(
            "cluster.time_min",
            "submitit counts every signal to a job of <= 10 minutes as a timeout, using up "
            "cluster.max_num_timeout on preemptions",
            "use cluster.time_min>10",
        )
    h = cfg.health
    if h.preflight not in ("off", "warn", "exclude", "drain"):
        r.error(
            "health.preflight", f"must be off, warn, exclude or drain, got {h.preflight!r}", "use health.preflight=warn"
        )
    if h.hang_timeout_s and h.hang_timeout_s < 10:
        r.error(
            "health.hang_timeout_s",
            f"{h.hang_timeout_s} s would fire on a slow step",
            "use at least 60 s, or 0 to disable",
        )
    if h.straggler_factor <= 1.0:
        r.error("health.straggler_factor", f"must be > 1, got {h.straggler_factor}", "use health.straggler_factor=1.3")
    if cfg.launcher.max_restarts < 0:
        r.error(
            "launcher.max_restarts", f"must be >= 0, got {cfg.launcher.max_restarts}", "use launcher.max_restarts=3"
        )
    if cfg.train.threads_per_rank > c.cpus_per_task and can.confines_cpus:
        r.warn(
            "train.threads_per_rank",
            f"{cfg.train.threads_per_rank} threads on {c.cpus_per_task} CPUs per task",
            "set train.threads_per_rank<=cluster.cpus_per_task",
        )


AGENT_SHUTDOWN_S = 30  # torch.distributed.elastic's LocalElasticAgent: SIGTERM, then SIGKILL after this
MIN_RENDEZVOUS_S = 2 * AGENT_SHUTDOWN_S


def _timeouts(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """hpctrain's hang watchdog must fire before NCCL's own (the collective timeout): it dumps stacks and the
    flight recorder and writes the failure record the supervisor blames a node by; NCCL's ends the process
    without any of that."""
    h, timeout = cfg.health, cfg.launcher.collective_timeout_s
    rendezvous = cfg.launcher.rendezvous_timeout_s
    if cfg.launcher.in_allocation and rendezvous < MIN_RENDEZVOUS_S:
        r.error(
            "launcher.rendezvous_timeout_s",
            f"{rendezvous} s: a restart inside the allocation stops every "
            f"worker (torch's agent waits up to {AGENT_SHUTDOWN_S} s before SIGKILL) and starts new ones; "
            "agents that wait less give up on a node that is only slow to restart",
            f"use launcher.rendezvous_timeout_s>={MIN_RENDEZVOUS_S} (default 600)",
        )
    if timeout < 30:
        r.error(
            "launcher.collective_timeout_s",
            f"{timeout} s is shorter than a checkpoint load or a slow first step",
            "use launcher.collective_timeout_s=1800",
        )
        return
    if not h.hang_timeout_s:  # the watchdog is off: NCCL's timeout is the only one
        return
    key, longest = max(
        (("health.hang_timeout_s", h.hang_timeout_s), ("health.startup_timeout_s", h.startup_timeout_s)),
        key=lambda kv: kv[1],
    )
    if timeout < longest + TIMEOUT_MARGIN_S:
        r.error(
            "launcher.collective_timeout_s",
            f"{timeout} s does not outlast {key}={longest:g} s by "
            f"{TIMEOUT_MARGIN_S:g} s: NCCL's own watchdog would end the ranks of a hang first, leaving no "
            "stacks, flight recorder or failure record",
            f"set launcher.collective_timeout_s>={math.ceil(longest + TIMEOUT_MARGIN_S)}, or lower {key}",
        )


def _elastic(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Spares and shrinking need the agents (and spares a batch system with nodes); every node count the run
    may shrink to must hold the same global batch (DP divides it, TP x PP fit)."""
    low, nodes, spare = cfg.elastic.min_nodes, cfg.cluster.nodes, cfg.cluster.spare_nodes
    if spare < 0:
        r.error("cluster.spare_nodes", f"must be >= 0, got {spare}", "use cluster.spare_nodes=0")
    elif spare and not cfg.launcher.in_allocation:
        r.error(
            "cluster.spare_nodes",
            "a spare replaces a node inside the allocation, but launcher.in_allocation=false",
            "set launcher.in_allocation=true, or cluster.spare_nodes=0",
        )
    elif spare and not (backend := scheduler_for(cfg.cluster.executor)).capabilities.multi_node:
        r.error(
            "cluster.spare_nodes",
            f"the {backend.name} executor runs one node: there is no node to spare",
            "use cluster.spare_nodes=0, or cluster=slurm",
        )
    if not low:
        return
    if not cfg.launcher.in_allocation:
        r.error(
            "elastic.min_nodes",
            "shrinking happens inside the allocation, but launcher.in_allocation=false",
            "set launcher.in_allocation=true, or elastic.min_nodes=0",
        )
        return
    if not 1 <= low <= nodes:
        r.error(
            "elastic.min_nodes",
            f"must be between 1 and cluster.nodes={nodes}, got {low}",
            f"use elastic.min_nodes={max(1, nodes - 1)}, or 0 to never shrink",
        )
        return
    for n, layout in layouts_on_nodes(cfg, range(low, nodes)):
        if isinstance(layout, ConfigError):
            r.error(
                "elastic.min_nodes",
                f"on {n} of {nodes} nodes the run does not fit: {layout.problems[0].message}",
                f"use elastic.min_nodes={n + 1}, or a global batch that every DP size from {low} nodes divides",
            )
            return


def _recovery(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """Replica groups (recovery=replicas|diloco) need the node agents (they host the lighthouse and restart a
    group in the allocation), never shrink (a group left out is the shrink), and a quorum they can reach."""
    rec = cfg.recovery
    if rec.mode not in RECOVERY_MODES:
        r.error("recovery.mode", f"unknown mode {rec.mode!r}", f"use one of {', '.join(RECOVERY_MODES)}")
        return
    if rec.mode == "restart":
        return
    if rec.groups < 2:
        r.error(
            "recovery.groups",
            f"recovery.mode={rec.mode} needs at least 2 replica groups, got {rec.groups}",
            "set recovery.groups=2 or more, or recovery=restart",
        )
    if not cfg.launcher.in_allocation:
        r.error(
            "launcher.in_allocation",
            f"recovery.mode={rec.mode}: each node's agent restarts its group and the agents host the lighthouse, "
            "but launcher.in_allocation=false",
            "set launcher.in_allocation=true, or recovery=restart",
        )
    if cfg.elastic.min_nodes:
        r.error(
            "elastic.min_nodes",
            f"recovery.mode={rec.mode}: a group that loses a node is left out of the quorum until it is back; "
            "groups do not shrink",
            "set elastic.min_nodes=0 (give the job cluster.spare_nodes to bring groups back)",
        )
    if not 1 <= rec.min_replicas <= rec.groups:
        r.error(
            "recovery.min_replicas",
            f"must be between 1 and recovery.groups={rec.groups}, got {rec.min_replicas}",
            "use recovery.min_replicas=1 (a step commits with any one group alive)",
        )
    if importlib.util.find_spec("torchft") is None:
        r.warn(
            "recovery.mode",
            f"recovery.mode={rec.mode} needs torchft on the compute nodes, and it is not installed here",
            "pip install 'hpctrain[replicas]' (torchft) where the job runs",
        )


SBATCH_STRINGS = ("partition", "account", "qos", "constraint", "exclude")  # each an #SBATCH option's value
SBATCH_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # cluster.sbatch_extra's keys: --<key>=<value>
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _blank(text: str) -> bool:
    """A space (or another blank that is not a control character: those are reported by _control_characters)."""
    return any(ch.isspace() and ord(ch) >= 32 and ord(ch) != 127 for ch in text)


def _sbatch_values(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """What reaches the sbatch script (hpctrain/scheduler/slurm.py) or submitit must be a value Slurm takes: names
    and lists without blanks, sizes and counts >= 0, `--key=value` options with a name and a scalar value (quoted
    by submitit: a --comment may hold blanks)."""
    c = cfg.cluster
    for name in SBATCH_STRINGS:
        value = getattr(c, name)
        if value is not None and _blank(str(value)):
            r.error(
                f"cluster.{name}",
                f"{str(value)!r} holds a blank: Slurm {name} names and lists have none "
                f"(sbatch --{name}={value!s} is refused or means something else)",
                f"remove the blank; several {name} values are separated by commas"
                if name != "constraint"
                else "combine features with & and | (e.g. 'a100&ib'), no blanks",
            )
    if c.mem_gb < 0:
        r.error(
            "cluster.mem_gb",
            f"must be >= 0 (0: the partition's default memory), got {c.mem_gb}",
            "set cluster.mem_gb=0, or the memory per node in GB",
        )
    if c.max_num_timeout < 0:
        r.error(
            "cluster.max_num_timeout",
            f"must be >= 0 requeues, got {c.max_num_timeout}",
            "use cluster.max_num_timeout=20",
        )
    for option, value in dict(c.sbatch_extra).items():
        key = f"cluster.sbatch_extra.{option}"
        if not SBATCH_OPTION.fullmatch(str(option)):
            r.error(
                key,
                f"{str(option)!r} is not an sbatch option name (it becomes #SBATCH --{option}=...)",
                "use the long option's name without dashes, e.g. +cluster.sbatch_extra.gres=gpu:8",
            )
        elif value is None or value is False or isinstance(value, (dict, list)) or OmegaConf.is_config(value):
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            r.error(
                key,
                f"{shown!r} renders as #SBATCH --{option}={shown}: a value must be a string or number, or "
                "true for an option without one",
                f"set {key} to the option's value, or remove it",
            )
        elif str(option) == "export" and "ALL" not in str(value).split(","):
            r.error(
                key,
                f"#SBATCH --export={value} starts the job without this machine's environment, and its srun "
                "step inherits the setting: SUBMITIT_EXECUTOR, which the batch script exports for submitit, and "
                "the credentials hpctrain passes through the environment (cluster.env) would not reach the tasks",
                "remove it, or keep the environment: +cluster.sbatch_extra.export=ALL,NAME=value",
            )
    for name in dict(c.env):
        if not ENV_NAME.fullmatch(str(name)):
            r.error(
                f"cluster.env.{name}",
                f"{str(name)!r} is not an environment variable name (letters, digits, "
                "_; not starting with a digit): the tasks could not set it",
                "rename the variable",
            )


def _log_paths(cfg: Config, lay: Layout, r: CheckReport) -> None:
    """The batch script names the tasks' logs `<run dir>/submitit/%j_%t_log.out` (sbatch's --output, srun's): Slurm
    reads '%' in them as a replacement symbol, and a backslash anywhere turns the symbols off, so every task would
    write one file that submitit and the supervisor do not look for."""
    if not scheduler_for(cfg.cluster.executor).capabilities.log_path_patterns:
        return
    for key, text in run_dir_parts(cfg):
        bad = next((ch for ch in "%\\" if ch in text), None)
        if bad:
            r.error(
                key,
                f"{text!r} holds {bad!r}: the run directory is part of the task logs' path, which Slurm reads "
                "as a filename pattern ('%' starts a replacement symbol, a backslash turns them off)",
                f"choose a {key} without '%' or '\\'",
            )


cluster_checks = [
    _cluster,
    _timeouts,
    _elastic,
    _recovery,
    _control_characters,
    _sbatch_values,
    _log_paths,
    container_checks,
]
