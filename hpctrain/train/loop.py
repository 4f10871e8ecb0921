"""The training loop that runs on every task, under the local executor and under Slurm alike.

environment (ranks, variables, process group) -> engine (mesh, model, layout) -> checkpoint (resume) ->
steps (data, step, metrics, periodic save) -> tracking. Nothing here imports the launch side.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hpctrain.checkpoint.hf import load_hf
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config.layout import Layout, layout_on_nodes, resolve_layout
from hpctrain.config.schema import TIMEOUT_MARGIN_S, Config, as_config, as_node, to_plain
from hpctrain.data.loader import BatchReader, open_datasets, validation_batches
from hpctrain.distributed.environment import (
    DistEnv,
    discover,
    init_distributed,
    shutdown,
    task_device,
)
from hpctrain.distributed.replicas import ReplicaPlace
from hpctrain.distributed.task_env import task_environment
from hpctrain.health.gpu_free import wait_for_free_gpu
from hpctrain.health.monitor import RunMonitor
from hpctrain.health.preflight import UnhealthyNodes, run_preflight
from hpctrain.health.watchdog import Watchdog
from hpctrain.parallel.compile import CompileClock
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.precision import configure_device_math
from hpctrain.records.failures import (
    attempt_key,
    condemned_hosts,
    diagnose,
    free_restart,
    read_failures,
    read_hosts,
    record_failure,
    record_hosts,
    same_failure,
)
from hpctrain.records.fingerprint import fingerprint_of
from hpctrain.records.history import ATTEMPT_MARKS
from hpctrain.records.jobs import read_completed, write_completed, write_report
from hpctrain.records.lease import LeaseWatch, StaleAttempt, current_lease, holds, settle_time, take_lease
from hpctrain.records.paths import RunPaths
from hpctrain.tracking.tracker import Tracker
from hpctrain.train.control import StepControl
from hpctrain.train.faults import Fault
from hpctrain.train.lr_schedule import lr_at
from hpctrain.train.preemption import (
    REASONS,
    StopFlag,
    agree_any,
    requeue_own_job,
    wait_to_be_ended,
)
from hpctrain.train.progress import StepReporter
from hpctrain.train.replicated import ReplicaGroup, group_config, group_run_dir, main_run_dir, run_completed

log = logging.getLogger("hpctrain")


def load_config(config: dict[str, Any]) -> Config:
    """Rebuild the typed config on the task from the plain dict the launcher pickled."""
    return as_config(OmegaConf.merge(OmegaConf.structured(Config), config))


def train(
    config: dict[str, Any], run_dir: str, layout: Layout | None = None, process_started: float | None = None
) -> dict[str, Any]:
    """One task's whole run. `layout` is the one the login node resolved and checked (tools and tests that
    call this directly may leave it to be resolved here from the same config). `process_started`: when the
    process began (an elastic worker's), the first mark of the attempt's start-up timeline."""
    timeline = {"process_started": process_started or time.time(), "imported": time.time()}
    place = ReplicaPlace.from_env() if config.get("recovery", {}).get("mode", "restart") != "restart" else None
    run_dir = str(group_run_dir(Path(run_dir), place))  # group g > 0 of replica groups: a folder of its own
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = load_config(group_config(config, place))
    if place is not None and place.group > 0:  # the group's folder reads as a run directory (tools, status)
        OmegaConf.save(as_node(cfg), RunPaths(Path(run_dir)).config, resolve=True)
    if place is not None and run_completed(main_run_dir(Path(run_dir), place), place.groups, cfg.train.max_steps):
        log.info("replica group %d: the run is complete already; nothing to train", place.group)
        return {"rank": -1, "completed": True}
    layout = layout or resolve_layout(cfg)
    os.environ.update(task_environment(cfg))
    torch.set_num_threads(cfg.train.threads_per_rank)
    env = discover()
    device = task_device(env.local_rank)
    _expect_a_gpu(str(cfg.cluster.gpu_type), device)
    if device.type == "cuda":  # NCCL reads these when its communicators start: set them before
        os.environ.update(node_nccl_environment(cfg, env.local_rank))
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        force=True,  # a forked worker: the agent's too
        format=f"[rank{env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("submitit").propagate = False  # submitit prints its own lines already
    log.info(
        "task rank %d/%d local %d on %s (job %s, restart %d), rendezvous %s:%d",
        env.rank,
        env.world_size,
        env.local_rank,
        env.hostname,
        env.job_id,
        env.restart,
        env.master_addr,
        env.master_port,
    )
    if env.world_size != layout.world_size:  # the agents went on without lost nodes (elastic.min_nodes)
        smaller = layout_on_nodes(cfg, env.num_nodes)
        log.warning(
            "running on %d of %d nodes: DP %d -> %d, gradient accumulation %d -> %d (global batch %d)",
            env.num_nodes,
            layout.nodes,
            layout.dp,
            smaller.dp,
            layout.grad_accum,
            smaller.grad_accum,
            smaller.global_batch,
        )
        layout = smaller
    try:  # before the first allocation on the GPU (the process group's communicator is one)
        wait_for_free_gpu(device, env.hostname)
    except UnhealthyNodes as exc:  # the supervisor resubmits without this node
        record_failure(Path(run_dir), env.attempt, env.rank, 0, exc, peer=False, blame=exc.hosts)
        raise
    init_distributed(env, device, timeout_s=cfg.launcher.collective_timeout_s)
    env = agree_on_restart(env, Path(run_dir))
    timeline["joined"] = time.time()
    repeated = repeated_failure(Path(run_dir), env)
    if repeated:  # every rank reads the same records: all stop together
        log.error("rank %d: not starting restart %d: %s", env.rank, env.restart, repeated["why"])
        if env.is_main:
            write_report(Path(run_dir), repeated)
        shutdown()
        return {"rank": env.rank, "stopped": repeated["why"]}
    condemned = condemned_hosts(Path(run_dir), attempt_key(env.job_id, 0, env.requeue), env.restart)
    if condemned:  # the same nodes again cannot pass: leave the allocation, the supervisor excludes them
        log.error("rank %d: not restarting on %s, condemned by the health checks", env.rank, ",".join(condemned))
        shutdown()
        return {"rank": env.rank, "leave": condemned}
    try:
        return _train(cfg, layout, Path(run_dir), env, timeline, place)
    except UnhealthyNodes as exc:  # the supervisor resubmits without the nodes named here
        record_failure(Path(run_dir), env.attempt, env.rank, 0, exc, peer=False, blame=exc.hosts)
        raise
    except StaleAttempt as exc:  # ends cleanly (exit 0): the newer attempt carries the run on
        log.warning("rank %d: %s; this attempt stops without writing", env.rank, exc)
        return {"rank": env.rank, "stale": True}
    finally:
        shutdown()


def _expect_a_gpu(gpu_type: str, device: torch.device) -> None:
    """A run planned for GPUs that finds none (a driver error, CUDA_VISIBLE_DEVICES emptied, a CPU build of
    torch) would train on gloo and the CPU, slowly and without a word: it stops here instead."""
    if gpu_type == "cpu" or device.type == "cuda":
        return
    raise RuntimeError(
        f"cluster.gpu_type={gpu_type} but this task sees no GPU (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, torch {torch.__version__} built "
        f"{'with CUDA ' + str(torch.version.cuda) if torch.version.cuda else 'without CUDA'}): check the node's driver "
        "(nvidia-smi) and the job's GPU request, or set cluster.gpu_type=cpu to train on CPUs"
    )


def agree_on_restart(env: DistEnv, run_dir: Path) -> DistEnv:
    """The job's restart number, the same on every rank and used by no earlier attempt of this job run: each
    agent counts its own restarts (a hot spare that just took a dead node's place starts at 0 where the others
    are at 1 or more), and none counts a change of members (a spare replacing a hung node), so rank 0 puts in
    the first number free on record (one read of the run directory, not one per rank). One all-reduce (MAX)
    of one CPU number on the default group's gloo backend, once per attempt."""
    restart = free_restart(run_dir, env.job_id, env.restart, env.requeue) if env.is_main else env.restart
    if dist.is_initialized() and env.world_size > 1:
        count = torch.tensor([restart], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        restart = int(count.item())
    return dataclasses.replace(env, restart=restart)


def repeated_failure(run_dir: Path, env: Any) -> dict[str, Any] | None:
    """The report that stops a restart loop inside the allocation: the two attempts before this restart
    ended with the same error at the same step (a deterministic failure); None when this restart may run."""
    if env.restart < 2:
        return None
    sigs = [
        diagnose(read_failures(run_dir, key), read_hosts(run_dir, key))[1]
        for key in (
            attempt_key(env.job_id, env.restart - 2, env.requeue),
            attempt_key(env.job_id, env.restart - 1, env.requeue),
        )
    ]
    sig = sigs[1]
    if sig is None or not same_failure(*sigs):
        return None
    return {
        "job_id": env.job_id,
        "action": "stop",
        "time": time.time(),
        "signature": sig,
        "restarts": env.restart - 1,
        "why": f"deterministic failure: the same error at step {sig['step']} on two attempts in a row "
        f"({sig['type']}: {sig['message']}); restarting would loop. Fix the cause, then resume "
        "with run.resume",
    }


class Preempted(Exception):
    """Training stopped at a step boundary on a signal, after a checkpoint; the job was requeued if possible."""


def _train(
    cfg: Config,
    layout: Layout,
    run_dir: Path,
    env: Any,
    timeline: dict[str, float] | None = None,
    place: ReplicaPlace | None = None,
) -> dict[str, Any]:
    device = task_device(env.local_rank)
    configure_device_math(bool(cfg.precision.tf32), device)
    taken = take_lease(run_dir, env.job_id) if env.is_main else None  # this attempt now holds the run
    hosts = _record_hosts(run_dir, env)  # a collective: every rank reads the lease after rank 0 took it
    lease = taken or current_lease(run_dir)
    timeline = {**(timeline or {}), "leased": time.time()}
    # Started before the pre-flight (whose collectives can hang too), with a limit below the collective
    # timeout: it must fire before NCCL's own watchdog, to leave stacks, the flight recorder and a record.
    watchdog = Watchdog(
        run_dir,
        env.attempt,
        env.rank,
        cfg.health.hang_timeout_s,
        cfg.health.hang_factor,
        cfg.health.startup_timeout_s,
        ceiling_s=cfg.launcher.collective_timeout_s - TIMEOUT_MARGIN_S,
    ).start()
    run_preflight(cfg, env.rank, env.local_rank, env.attempt, run_dir, device)
    stop, tracker, stats, done = StopFlag(on_signal=lambda _: watchdog.stop_signalled()), None, None, 0
    reader: BatchReader | None = None
    watch: LeaseWatch | None = None
    group: ReplicaGroup | None = None
    try:  # from here every error leaves a failure record: start-up (engine, resume) as much as the steps
        timeline["checked"] = time.time()  # the watchdog started, the pre-flight passed
        monitor = RunMonitor(cfg.health, env.rank, device, hosts)
        engine, ckpt, start_step, consumed = _resume(cfg, layout, run_dir, env, device, timeline)
        timeline["resumed"] = time.time()
        done = start_step
        t = cfg.train
        if place is not None:  # the step's quorum, average and vote across the replica groups (torchft)
            group = ReplicaGroup(cfg, place, env, engine, device, start_step, consumed, main_run_dir(run_dir, place))
        samples_per_step = group.samples_per_step if group is not None else layout.global_batch
        data = open_datasets(cfg.data, t.seq_len, t.seed)
        if env.is_main:
            log.info(
                "data: train %s; validation %s",
                data.train.describe(),
                data.valid.describe() if data.valid is not None else "none",
            )
        reader = BatchReader(
            data.train,
            layout.global_batch,
            layout.micro_batch,
            engine.dp_size,
            engine.dp_rank,
            pin=device.type == "cuda",
            ahead=cfg.data.prefetch,
            vocab_size=cfg.data.vocab_size,
            stride=samples_per_step,
        )
        validation = Validation(cfg, layout, engine, data.valid) if t.eval_every else None
        if env.is_main:
            assert taken is not None  # rank 0 took the lease
            time.sleep(max(0.0, settle_time(taken, timeline["leased"], cfg.run.lease_check_s) - time.time()))
            # the run's ledger (its config, its jobs) is made by group 0 of replica groups
            tracker = Tracker(cfg, run_dir, str(cfg.run.id), to_plain(cfg), ledger=place is None or place.group == 0)
            for e in ckpt.events:  # what the resume did: the tier used and the ones skipped, and why
                tracker.event(e.pop("event"), **e)
            ckpt.events.clear()
        reporter = StepReporter(
            cfg, layout.global_batch * t.seq_len, env.world_size, device, start_step, ckpt.stop_tier()
        )
        fault = Fault.from_env()
        compiling = CompileClock()  # torch.compile's share of each step (parallel.compile), for the ledger
        watch = LeaseWatch(run_dir, taken, cfg.run.lease_check_s).start() if taken is not None else None  # rank 0
        control = StepControl(stop, ckpt, monitor, watch)
        stop.install()
        timeline["ready"] = time.time()  # data, tracker, reporter
        step = start_step
        while step < t.max_steps:
            started = time.perf_counter()
            if group is not None:  # a group behind the quorum heals here: it goes on from the peers' step
                step, consumed = group.before_step(step, consumed)
                if step >= t.max_steps:
                    break
            if fault is not None:
                fault.maybe_fire(step + 1, env.rank, run_dir)
            batches = reader.batches(group.first_sample(consumed) if group is not None else consumed)
            lr = lr_at(step, cfg.optim, t.max_steps)
            with compiling:
                stats = engine.step(batches, lr, control.values(step + 1))
            agreed = control.decode(stats.control)
            if agreed.stale:
                raise StaleAttempt(f"a newer attempt of this run took the lease before step {step + 1}")
            if group is not None:
                group.after_step(stats.committed, step + 1, consumed + samples_per_step)
                if tracker is not None:
                    for e in group.take_events():
                        tracker.event(e.pop("event"), **e)
                if not stats.committed:  # the quorum's average did not go through: this step again
                    continue
            # the step's wait for a save's copy of the state (before its optimizer step) is the checkpoint's time
            staging_wait = ckpt.take_staging_wait()
            step_time = time.perf_counter() - started - staging_wait
            done, consumed = step + 1, consumed + samples_per_step
            step = done
            watchdog.beat(done, step_time)
            saving = time.perf_counter()
            ckpt.after_step(done, engine, {"consumed_samples": consumed}, agreed.checkpoint)
            ckpt_s = time.perf_counter() - saving + staging_wait  # training stopped for a save (its copy, a busy tier)
            monitor_out = monitor.after_step(done, step_time, agreed.probes)
            evaluated = validation.after_step(done) if validation is not None else {}
            if evaluated:
                watchdog.touch()  # the next step's hang limit starts after the evaluation
            # rank 0's; lost during this step: stop at the next, writing nothing
            if tracker is not None and watch is not None and not watch.lost():
                reporter.step(
                    tracker,
                    done,
                    consumed,
                    stats,
                    lr,
                    step_time,
                    ckpt.events,
                    monitor_out,
                    {
                        "data_wait_s": reader.wait_s,
                        "ckpt_s": ckpt_s,
                        **compiling.report(),
                        **evaluated,
                        **(group.metrics() if group is not None else {}),
                    },
                )
                if "first_step" not in timeline:  # its first step (after a heal, past start_step + 1), part by part
                    timeline["first_step"] = time.time()
                    tracker.event(
                        "attempt",
                        job_id=env.job_id,
                        restart=env.restart,
                        requeue=env.requeue,
                        from_step=start_step,
                        **{mark: timeline[mark] for mark in ATTEMPT_MARKS if mark in timeline},
                    )
                    tracker.ledger(run_dir, background=True)  # with the previous attempt's end, now known
                tracker.poll()
            ckpt.events.clear()
            signum = agreed.signum
            if signum is not None and done < t.max_steps:
                if tracker is not None:
                    tracker.event("stop", reason=REASONS[signum], step=done)
                watchdog.leave()
                _stop_for_signal(signum, ckpt, engine, done, consumed, env, device, tracker, run_dir, watchdog)
        saving = time.perf_counter()
        ckpt.finish(done, engine, {"consumed_samples": consumed})
        if env.is_main and done == t.max_steps:
            write_completed(run_dir, env.job_id, done)
            if place is not None and place.group > 0:  # group 0 out at the end: the run ended in this group
                main = main_run_dir(run_dir, place)
                if read_completed(main) is None:
                    write_completed(main, env.job_id, done, replica_dir=str(run_dir.relative_to(main)))
        if tracker is not None:
            tracker.event(
                "attempt_end",
                how="completed" if done == t.max_steps else "ended",
                save_s=time.perf_counter() - saving,
                step=done,
            )
            tracker.ledger(run_dir)
    except (Preempted, StaleAttempt):
        raise
    except Exception as exc:
        if lease is not None and not holds(run_dir, lease):  # e.g. its start removed our unfinished saves
            raise StaleAttempt(f"a newer attempt of this run took the lease ({type(exc).__name__}: {exc})") from exc
        _record_own_failure(watchdog, run_dir, env, done + 1, exc)
        raise
    finally:
        if reader is not None:
            reader.close()
        if group is not None:
            group.close()
        if watch is not None:
            watch.stop()
        watchdog.stop()
        stop.restore()
        if tracker is not None:
            tracker.close()
    return {
        "rank": env.rank,
        "steps": t.max_steps,
        "start_step": start_step,
        "final_loss": stats.loss if stats else None,
    }


class Validation:
    """The validation loss every `train.eval_every` steps and at the last one: the same samples each time
    (read once, kept), averaged over every DP rank by the engine."""

    def __init__(self, cfg: Config, layout: Layout, engine: Any, valid: Any) -> None:
        self.every, self.last, self.engine = cfg.train.eval_every, cfg.train.max_steps, engine
        self.batches = validation_batches(
            valid,
            cfg.train.eval_batches,
            layout.global_batch,
            layout.micro_batch,
            engine.dp_size,
            engine.dp_rank,
            cfg.data.vocab_size,
        )
        wanted = cfg.train.eval_batches * layout.global_batch
        if wanted > valid.samples_per_epoch:
            log.warning(
                "validation: %d samples asked for (train.eval_batches=%d x global batch %d), the split "
                "holds %d: some are repeated",
                wanted,
                cfg.train.eval_batches,
                layout.global_batch,
                valid.samples_per_epoch,
            )

    def after_step(self, done: int) -> dict[str, float]:
        """{"val_loss", "eval_s"} at an evaluation step, else {}."""
        if done % self.every and done != self.last:
            return {}
        started = time.perf_counter()
        loss = self.engine.evaluate(self.batches)
        return {"val_loss": loss, "eval_s": time.perf_counter() - started}


def _record_own_failure(watchdog: Watchdog, run_dir: Path, env: Any, step: int, exc: Exception) -> None:
    """This rank's own failure record (the supervisor reads them to exclude nodes and to spot deterministic
    errors); the watchdog stands down first, so it cannot call a failing rank hung."""
    watchdog.stand_down()
    path = record_failure(run_dir, env.attempt, env.rank, step, exc)
    log.error("rank %d failed at step %d: %s: %s (record: %s)", env.rank, step, type(exc).__name__, exc, path)


def _resume(
    cfg: Config, layout: Layout, run_dir: Path, env: Any, device: torch.device, timeline: dict[str, float]
) -> tuple[Any, CheckpointManager, int, int]:
    """The engine, its checkpoint manager, and where training goes on: (step, samples consumed); `timeline`
    gets the marks of the parts (engine built, manager ready)."""
    engine = build_engine(cfg, layout, device)
    timeline["engine_built"] = time.time()
    ckpt = CheckpointManager(
        cfg.checkpoint,
        cfg.cluster.failure_rate_per_gpu_day,
        run_dir,
        str(cfg.run.id),
        env.rank,
        env.world_size,
        fingerprint_of(cfg.model, cfg.train, cfg.data).to_dict(),
        device,
    )
    engine.before_update = ckpt.wait_for_staging  # a save's copy of the state is taken before it changes
    # What is built now (torch, the model, its optimizer: hundreds of thousands of objects) lives for the run: out
    # of the collector's sight, a full collection no longer scans it. One took 0.14 s on a 92M-parameter model,
    # in a resume (most of its time, 1 in 3 resumes) and in any step, where a rank stalled by it stalls them all.
    gc.freeze()
    timeline["manager_ready"] = time.time()
    manifest = ckpt.resume(engine)
    if not manifest:
        if cfg.model.init_from:  # continued pretraining: a fresh run starts from a Hugging Face model's weights
            load_hf(engine.model_parts, cfg.model.init_from, cfg.model)
        return engine, ckpt, 0, 0
    step, consumed = int(manifest["step"]), int(manifest["consumed_samples"])
    log.info("resuming at step %d (%d samples consumed) from %s tier", step, consumed, manifest["tier"])
    return engine, ckpt, step, consumed


def _stop_for_signal(
    signum: int,
    ckpt: CheckpointManager,
    engine: Any,
    done: int,
    consumed: int,
    env: Any,
    device: torch.device,
    tracker: Tracker | None,
    run_dir: Path,
    watchdog: Watchdog,
) -> None:
    """All ranks: save to the fastest tier that outlives the allocation, wait for the commit; rank 0 books the
    save and the ledger and closes its tracker (its files complete before Slurm ends the tasks), then requeues
    on SIGUSR2; then stop."""
    log.warning("%s at step %d: saving and stopping", REASONS[signum], done)
    saving = time.perf_counter()
    ckpt.save_now(done, engine, {"consumed_samples": consumed}, ckpt.stop_tier())
    watchdog.stop()  # saved: waiting to be ended is not a hang
    if tracker is not None:
        tracker.event(
            "attempt_end", how="stopped", reason=REASONS[signum], save_s=time.perf_counter() - saving, step=done
        )
        tracker.ledger(run_dir)
        tracker.close()
    requeued = env.is_main and signum == signal.SIGUSR2 and requeue_own_job()
    if agree_any(requeued, device):
        # Slurm ends every task of a requeued job; exiting first would make srun report a failure.
        wait_to_be_ended()
    raise Preempted(f"stopped at step {done} on {REASONS[signum]}; checkpoint committed")


def node_nccl_environment(cfg: Config, local_rank: int) -> dict[str, str]:
    """NCCL variables from this node's topology and InfiniBand ports, for what the config left unset."""
    from hpctrain.distributed.nccl_env import apply, nccl_environment
    from hpctrain.health.node import ib_report, topology_report

    env = nccl_environment(cfg.cluster.nccl, local_rank, topology_report(), ib_report())
    chosen = apply(env, {k: v for k, v in os.environ.items() if k not in task_environment(cfg)})
    log.info("NCCL environment from the node: %s", chosen)
    return chosen


def _record_hosts(run_dir: Path, env: Any) -> list[str]:
    """Every rank's host, by rank (once at start-up), for the supervisor and for naming stragglers."""
    hosts = [env.hostname]
    if dist.is_initialized():
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, env.hostname)
    if env.is_main:
        record_hosts(run_dir, env.attempt, hosts)
    return hosts
