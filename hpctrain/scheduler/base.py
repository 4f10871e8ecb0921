"""The scheduler seam: everything hpctrain asks of a batch system, as one small interface.

Like submitit's per-backend modules (`submitit.slurm`, `submitit.local`), a backend is one module of this
package implementing `Scheduler`. The launcher, the supervisor, and on the tasks training, health checks and
tracking ask `hpctrain.scheduler.scheduler_for(...)`; none of them runs sbatch, scontrol or sinfo, or reads
SLURM_* variables, itself, and none branches on the executor's name: a rule that holds for some batch systems
only asks the backend's `capabilities`. Supporting PBS would be one module and one entry in `BACKENDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import submitit

    from hpctrain.config.schema import ClusterConfig


@dataclass(frozen=True)
class JobSpec:
    """What the launcher asks for one run, in no backend's terms (`cluster` holds the site's settings)."""

    name: str
    folder: Path  # submitit's folder: batch scripts, pickles, task logs
    run_dir: Path  # what the tasks write (the folder is inside it): a container mounts it
    nodes: int
    tasks_per_node: int  # one per rank, or one per node (an elastic agent starts the node's ranks)
    gpus_per_node: int = 0  # GPUs the job asks each node for (0: a CPU job)
    cpus_per_task: int = 1
    # Keep the job and its tasks running when one of its nodes dies (the others go on without it).
    survive_node_loss: bool = False
    # Run once after the tasks end, with the job id and the tasks' exit status appended as its last two
    # arguments (the supervisor). A backend without a batch script has no "after" and ignores it.
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Capabilities:
    """What a batch system does for a run, as the checks, the launcher and the tasks ask it: each rule that holds
    for some batch systems only asks its question here, never the executor's name, so a new backend answers
    these and gets the rules that fit it."""

    # The job can span several nodes: cluster.nodes > 1 and hot spares (cluster.spare_nodes) mean something.
    multi_node: bool
    # The tasks are processes of the machine that submits them: its GPUs are theirs (checked against
    # cluster.gpus_per_node), a node-local path (zero.nvme_path) is checked as they will see it, and the
    # launcher follows the job to its end (the user waits at the console).
    runs_here: bool
    # The batch system sends a warning signal cluster.signal_delay_s before the time limit, and a long run stops
    # there with a checkpoint to go on in its next allocation: the delay must hold a step and a save (checked on
    # the login node, measured by the run). A time limit that only ends a run the user watches does not count.
    warning_signal: bool
    # The batch system puts a preempted job back in the queue (cluster.requeue) and a task can requeue its own
    # job (`requeue_self`); submitit tells a preemption from a timeout by how long the job ran, and counts every
    # signal to a job of <= 10 minutes as a timeout.
    requeue: bool
    # Each task runs on its cluster.cpus_per_task CPUs and no others (Slurm binds it to them): more threads per
    # rank than that only share them.
    confines_cpus: bool
    # The tasks can run inside cluster.container: the batch script starts them through srun, which pyxis plugs
    # into and which runs apptainer's command.
    containers: bool
    # cluster.srun_args reach the srun that starts the tasks (so they are checked as srun parses them).
    srun_args: bool
    # The tasks' log paths, inside the run directory, are filename patterns the batch system expands (Slurm's
    # %j, %t; a backslash turns them off): the run directory may hold neither '%' nor a backslash.
    log_path_patterns: bool


@dataclass(frozen=True)
class Allocation:
    """One run of a job on its nodes, as the batch system accounted it: a requeued job has one per run, the
    same id each time. Times are seconds since the epoch (whole seconds under Slurm); None where the batch
    system has none (`end` while the job runs, `start` while it waits)."""

    job_id: str
    state: str  # the batch system's word: COMPLETED, REQUEUED, PREEMPTED, TIMEOUT, NODE_FAIL, FAILED, RUNNING...
    submit: float | None
    eligible: float | None  # when it could have started: a requeued job is held a while first
    start: float | None
    end: float | None
    nodes: int
    node_list: str = ""  # the batch system's compact form: n[1-2,4]
    exit_code: str = ""
    reason: str = ""
    suspended_s: float = 0.0  # how long the batch system held it suspended (`scontrol suspend`), in all


class Scheduler(ABC):
    """One batch system: what it can do (`capabilities`), submission on the login node, the supervisor's
    queries, the tasks' requests."""

    name: str
    capabilities: Capabilities

    # The login node.
    @abstractmethod
    def executor(self, cluster: ClusterConfig, job: JobSpec) -> submitit.Executor:
        """The submitit executor that submits the job."""

    @abstractmethod
    def script(self, cluster: ClusterConfig, job: JobSpec) -> str | None:
        """The batch script the executor submits, rendered from the same parameters (the dry-run plan shows
        it); None for a backend that submits none."""

    # The supervisor, in the batch script after the tasks.
    @abstractmethod
    def partition_nodes(self, partition: str | None) -> list[str]:
        """Every node of a partition (the default one when None), whatever its state; [] when unknown."""

    @abstractmethod
    def resubmit(self, folder: Path, job_id: str, exclude: list[str]) -> str:
        """Submit a finished job again (same script, same pickle) without `exclude`; the new job id."""

    @abstractmethod
    def cancel_requeue(self, job_id: str) -> bool:
        """Make sure the batch system will not requeue this (failing) job by itself; False if it can't."""

    # The supervisor, the tasks and `python -m hpctrain.status`.
    @abstractmethod
    def accounting(self, job_ids: list[str], timeout_s: float = 60) -> list[Allocation] | None:
        """Every run of these jobs (requeues included), oldest first; None when the batch system keeps no
        accounting (the local executor): the queue wait is then unknown, not zero."""

    # The tasks.
    @abstractmethod
    def requeue_self(self) -> bool:
        """Put the job this task belongs to back in the queue; False when that is not possible."""

    @abstractmethod
    def end_self(self) -> bool:
        """End the job this task belongs to, from inside: its batch script, which would have ended it, died with
        its node (the run itself is done); False when that is not possible."""

    @abstractmethod
    def drain(self, hosts: list[str], reason: str) -> bool:
        """Take nodes out of service for every job; False when that is not possible."""

    @abstractmethod
    def job_context(self) -> dict[str, Any]:
        """The job this task runs in (id, restarts, nodes), for the run's tracking."""
