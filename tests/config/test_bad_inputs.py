"""The bad-input suite: each bad config fails with its own message naming the key, and submits nothing.

In-process cases go through `hpctrain.launch.cli.run`, the function `python -m hpctrain` calls, with the run
root in a temporary directory that must stay empty. Schema-level mistakes (typos, wrong types) fail during
Hydra composition; those run through the real command line.

Siblings, one class of hostile input each (issue 46), held to the same rule (the exit code, the key, the fix, what
is left on disk), and every command any test runs to a fourth: no Python traceback on the console
(`tests.conftest.run_hpctrain` fails the test that sees one):
- Hydra's own errors (typo'd key, wrong type, unknown option, bad enum, bad site YAML, a link loop in
  HPCTRAIN_CONFIG_PATH), all at once: tests/config/test_hydra_errors.py
- values that reach a script (the generated batch script run under bash), container options parsed as the runtime
  parses them: tests/config/test_script_injection.py
- a run's checkpoints through a link into another run (the other run's hashes unchanged):
  tests/checkpoint/test_run_isolation.py; a resume that would change the model's shape, an unreadable saved
  config, a finished run: tests/launch/test_resume_refusals.py
- files the login node reads (devices, FIFOs, huge or binary files): tests/config/test_file_reads.py
- every numeric key's domain, sizes no GPU or host can allocate: tests/config/test_numeric_domains.py
- sweeps that would share a run directory, a dry-run sweep that writes nothing: tests/launch/test_sweep_refusals.py
- a failed job (the failure record and the log, no traceback): tests/launch/test_job_failure.py
- damaged run directories under the status page and the checkpoint tool: tests/tools/test_status_cli.py,
  tests/tools/test_checkpoint_tool_damage.py
- credentials under any name or shape: tests/launch/test_secrets.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.launch.cli import EXIT_CONFIG_ERROR, run
from tests.conftest import run_hpctrain

# (id, overrides, key named, words of the message)
BAD = [
    ("dp-mismatch", ["parallel.dp=3"], "parallel.dp", "dp x tp x pp"),
    ("dp-not-inferable", ["parallel.tp=3"], "parallel.dp", "cannot be inferred"),
    ("global-batch-indivisible", ["train.global_batch=20"], "train.global_batch", "not divisible"),
    ("batch-arithmetic", ["train.grad_accum=3"], "train.global_batch", "micro_batch x grad_accum x dp"),
    ("heads-vs-hidden", ["model.n_heads=3"], "model.d_model", "not divisible by n_heads"),
    ("heads-vs-tp", ["cluster.gpus_per_node=8", "parallel.tp=8"], "parallel.tp", "whole attention heads"),
    (
        "kv-heads-vs-heads",
        ["model=llama_tiny", "model.n_kv_heads=3"],
        "model.n_kv_heads",
        "not divisible by n_kv_heads=3",
    ),
    (
        "kv-heads-vs-tp",
        ["model=llama_tiny", "cluster.gpus_per_node=4", "parallel.tp=4"],
        "parallel.tp",
        "model.n_kv_heads=2 is not divisible by tp=4",
    ),
    (
        "ffn-hidden-vs-tp",
        ["model=llama_tiny", "model.ffn_hidden=353", "parallel.tp=2"],
        "parallel.tp",
        "MLP hidden size 353 is not divisible by tp=2",
    ),
    ("odd-rope-head-dim", ["model=llama_tiny", "model.d_model=132"], "model.d_model", "RoPE rotates pairs"),
    ("llama-dropout", ["model=llama_tiny", "model.dropout=0.1"], "model.dropout", "has no dropout"),
    ("gpt-kv-heads", ["model.n_kv_heads=2"], "model.n_kv_heads", "multi-head attention only"),
    (
        "init-from-missing",
        ["model=llama_tiny", "model.init_from=/nonexistent/Llama-3.1-8B"],
        "model.init_from",
        "/nonexistent/Llama-3.1-8B does not exist",
    ),
    (
        "layers-vs-pp",
        ["model.n_layers=3", "parallel.pp=2", "train.micro_batch=4"],
        "parallel.pp",
        "not divisible by pp",
    ),
    (
        "tp-across-nodes",
        ["+experiment=175b", "cluster.gpus_per_node=4", "parallel.dp=-1", "train.grad_accum=-1"],
        "parallel.tp",
        "larger than cluster.gpus_per_node",
    ),
    (
        "tp-straddles-nodes",
        ["+experiment=175b", "cluster.gpus_per_node=6", "parallel.tp=4", "parallel.dp=-1", "train.grad_accum=-1"],
        "parallel.tp",
        "straddle",
    ),
    (
        "too-few-microbatches",
        ["parallel.pp=2", "train.micro_batch=16"],
        "train.grad_accum",
        "at least one microbatch per stage",
    ),
    (
        "interleaved-needs-virtual",
        ["parallel.pp=2", "parallel.schedule=interleaved_1f1b", "train.micro_batch=4"],
        "parallel.schedule",
        "virtual_stages >= 2",
    ),
    (
        "virtual-needs-interleaved",
        ["parallel.pp=2", "parallel.virtual_stages=2", "train.micro_batch=4"],
        "parallel.virtual_stages",
        "multi-chunk schedule",
    ),
    (
        "zero-bubble-with-zero",
        [
            "cluster.gpus_per_node=4",
            "parallel.pp=2",
            "parallel.virtual_stages=2",
            "parallel.schedule=zbv",
            "zero=stage3",
            "train.global_batch=16",
            "train.micro_batch=2",
        ],
        "parallel.schedule",
        "separate pass",
    ),
    ("unknown-schedule", ["parallel.schedule=2f2b"], "parallel.schedule", "unknown schedule"),
    (
        "fp16-no-scaling",
        ["precision=fp16", "precision.loss_scaling=false"],
        "precision.loss_scaling",
        "fp16 without loss scaling",
    ),
    ("zero-stage-4", ["zero.stage=4"], "zero.stage", "must be 0, 1, 2 or 3"),
    (
        "param-offload-stage2",
        ["zero=stage2", "zero.offload_params=true", "zero.offload_optimizer=true"],
        "zero.offload_params",
        "needs ZeRO stage 3",
    ),
    ("optim-offload-stage1", ["zero=stage1", "zero.offload_optimizer=true"], "zero.offload_optimizer", "stage 2 or 3"),
    (
        "param-offload-alone",
        ["zero=stage3", "zero.offload_params=true"],
        "zero.offload_optimizer",
        "optimizer step runs there too",
    ),
    ("hsdp-without-sharding", ["parallel.dp_replicate=2"], "parallel.dp_replicate", "HSDP"),
    ("tiny-buckets", ["zero.reduce_bucket_size=100"], "zero.reduce_bucket_size", "too small"),
    ("seq-beyond-context", ["train.seq_len=512"], "train.seq_len", "model.context=256"),
    ("vocab-too-small", ["data=synthetic"], "data.vocab_size", "model.vocab_size=256"),
    (
        "tokens-missing-file",
        ["model=gpt3_125m", "data=tokens", "data.path=/nonexistent/train.bin", "train.seq_len=128"],
        "data.path",
        "does not exist",
    ),
    ("tokens-no-path", ["model=gpt3_125m", "data=tokens", "train.seq_len=128"], "data.path", "needs the path"),
    ("indexed-no-blend", ["data=indexed", "data.vocab_size=256"], "data.blend", "needs the prefix"),
    (
        "indexed-missing",
        ["data=indexed", "data.vocab_size=256", "data.blend=/nonexistent/pile_text_document"],
        "data.blend",
        "/nonexistent/pile_text_document.bin and /nonexistent/pile_text_document.idx not found",
    ),
    (
        "blend-odd",
        ["data=indexed", "data.vocab_size=256", "data.blend='0.3 /a 0.7'"],
        "data.blend",
        "not weight/prefix pairs",
    ),
    (
        "blend-zero-weight",
        ["data=indexed", "data.vocab_size=256", "data.blend='0 /a 1 /b'"],
        "data.blend",
        "must be > 0",
    ),
    ("valid-blend-flat", ["data.valid_blend=/data/v"], "data.valid_blend", "validation prefixes are for data=indexed"),
    (
        "valid-twice",
        ["data=indexed", "data.vocab_size=256", "data.blend=/a", "data.valid_blend=/v", "data.valid_fraction=0.1"],
        "data.valid_fraction",
        "both data.valid_blend",
    ),
    ("valid-fraction-1", ["data.valid_fraction=1.0"], "data.valid_fraction", "must be in [0, 1)"),
    ("eval-without-split", ["train.eval_every=10"], "train.eval_every", "no validation data is held out"),
    (
        "eval-batches-0",
        ["train.eval_every=10", "data.valid_fraction=0.01", "train.eval_batches=0"],
        "train.eval_batches",
        "must be >= 1",
    ),
    ("prefetch-negative", ["data.prefetch=-1"], "data.prefetch", "must be >= 0"),
    (
        "prepare-two-prefixes",
        ["data=indexed", "data.vocab_size=256", "data.blend='1 /a 1 /b'", "data.prepare.inputs=[stdlib]"],
        "data.prepare.inputs",
        "makes one dataset",
    ),
    (
        "prepare-missing-input",
        ["data=indexed", "data.vocab_size=256", "data.blend=/tmp/x", "data.prepare.inputs=[/nonexistent/corpus.jsonl]"],
        "data.prepare.inputs",
        "/nonexistent/corpus.jsonl does not exist",
    ),
    (
        "bad-token-dtype",
        ["model=gpt3_125m", "data=synthetic", "data.kind=tokens", "data.path=/x.bin", "data.token_dtype=uint8"],
        "data.token_dtype",
        "uint16 or uint32",
    ),
    (
        "signal-after-end",
        ["cluster.time_min=1", "cluster.signal_delay_s=120"],
        "cluster.signal_delay_s",
        "before the job starts",
    ),
    ("local-multi-node", ["cluster.nodes=2", "train.global_batch=32"], "cluster.nodes", "local executor"),
    ("zero-lr", ["optim.lr=0"], "optim.lr", "must be > 0"),
    ("min-lr-above-lr", ["optim.min_lr_ratio=2.0"], "optim.min_lr_ratio", "a fraction of optim.lr"),
    ("betas-out-of-range", ["optim.betas=[0.9,1.5]"], "optim.betas", "in [0, 1)"),
    ("negative-warmup", ["optim.warmup_steps=-1"], "optim.warmup_steps", "must be >= 0"),
    ("negative-clip", ["optim.grad_clip=-1"], "optim.grad_clip", "must be >= 0"),
    ("no-steps", ["train.max_steps=0", "optim.warmup_steps=0"], "train.max_steps", "must be >= 1"),
    ("zero-micro-batch", ["train.micro_batch=0"], "train.micro_batch", "must be >= 1"),
    ("keep-nothing", ["checkpoint.tiers.0.keep_last=0"], "checkpoint.tiers[0].keep_last", "newest checkpoint"),
    ("no-tiers", ["checkpoint.tiers=[]"], "checkpoint.tiers", "no tier"),
    ("added-unknown-key", ["+train.lr=1e-3"], "train.lr", "did you mean optim.lr?"),
    ("no-write-threads", ["checkpoint.write_threads=0"], "checkpoint.write_threads", "must be >= 1"),
    (
        "negative-failure-rate",
        ["cluster.failure_rate_per_gpu_day=-1"],
        "cluster.failure_rate_per_gpu_day",
        "must be >= 0",
    ),
    ("unknown-preflight-policy", ["health.preflight=reboot"], "health.preflight", "off, warn, exclude or drain"),
    ("hair-trigger-watchdog", ["health.hang_timeout_s=1"], "health.hang_timeout_s", "would fire on a slow step"),
    (
        "nccl-timeout-before-watchdog",
        ["launcher.collective_timeout_s=600"],
        "launcher.collective_timeout_s",
        "NCCL's own watchdog would end the ranks of a hang first",
    ),
    (
        "nccl-timeout-before-startup-limit",
        ["health.startup_timeout_s=1800"],
        "launcher.collective_timeout_s",
        "does not outlast health.startup_timeout_s=1800 s",
    ),
    ("impatient-rendezvous", ["launcher.rendezvous_timeout_s=20"], "launcher.rendezvous_timeout_s", "slow to restart"),
    (
        "shrink-breaks-the-batch",
        ["cluster=dev", "cluster.nodes=3", "train.global_batch=24", "train.micro_batch=4", "elastic.min_nodes=1"],
        "elastic.min_nodes",
        "on 2 of 3 nodes the run does not fit",
    ),
    (
        "shrink-without-agents",
        ["elastic.min_nodes=1", "launcher.in_allocation=false"],
        "elastic.min_nodes",
        "shrinking happens inside the allocation",
    ),
    ("spare-on-one-machine", ["cluster.spare_nodes=1"], "cluster.spare_nodes", "no node to spare"),
    ("busy-policy", ["checkpoint.when_busy=queue"], "checkpoint.when_busy", "skip or wait"),
    ("resume-unknown-run", ["run.resume=no-such-run"], "run.resume", "no run 'no-such-run' found"),
    # issue 29: values the job failed on, or that left run.root
    (
        "max-steps-overflow",
        ["train.max_steps=100000000000000000000"],
        "train.max_steps",
        "is more than 1,000,000,000 steps",
    ),
    (
        "blend-infinite-weight",
        ["data=indexed", "data.vocab_size=256", "data.blend='inf /a 1 /b'"],
        "data.blend",
        "the weight of /a is inf: weights must be finite",
    ),
    (
        "blend-weights-overflow",
        ["data=indexed", "data.vocab_size=256", "data.blend='1e308 /a 1e308 /b'"],
        "data.blend",
        "the weights add up to inf",
    ),
    ("signal-delay-negative", ["cluster.signal_delay_s=-1"], "cluster.signal_delay_s", "must be >= 0 seconds"),
    ("lease-check-zero", ["run.lease_check_s=0"], "run.lease_check_s", "must be > 0 seconds"),
    ("run-name-escapes", ["run.name=../../up"], "run.name", "outside run.root"),
    ("run-name-absolute", ["run.name=/tmp/elsewhere"], "run.name", "outside run.root"),
    ("run-id-escapes", ["run.id=../../../escape"], "run.id", "is not a directory name"),
    ("run-id-subdirectory", ["run.id=a/b"], "run.id", "is not a directory name"),
    (
        "tier-path-escapes",
        ["checkpoint.tiers.0.path=../../elsewhere"],
        "checkpoint.tiers[0].path",
        "leads out of the run directory",
    ),
    ("partition-with-a-blank", ["cluster.partition='gpu a100'"], "cluster.partition", "holds a blank"),
    ("constraint-with-a-blank", ["cluster.constraint='a100 & ib'"], "cluster.constraint", "holds a blank"),
    ("exclude-with-a-blank", ["cluster.exclude='node1, node2'"], "cluster.exclude", "holds a blank"),
    ("account-with-a-newline", ["cluster.account='llm\n#SBATCH --qos=high'"], "cluster.account", "control character"),
    ("memory-negative", ["cluster.mem_gb=-1"], "cluster.mem_gb", "must be >= 0"),
    ("requeues-negative", ["cluster.max_num_timeout=-1"], "cluster.max_num_timeout", "must be >= 0"),
    ("no-nodes", ["cluster.nodes=0"], "cluster.nodes", "must be >= 1"),
    ("no-gpus-per-node", ["cluster.gpus_per_node=0"], "cluster.gpus_per_node", "must be >= 1"),
    (
        "sbatch-extra-false",
        ["+cluster.sbatch_extra.gres=false"],
        "cluster.sbatch_extra.gres",
        "renders as #SBATCH --gres=False",
    ),
    (
        "sbatch-extra-mapping",
        ["+cluster.sbatch_extra.gres={gpu:8}"],
        "cluster.sbatch_extra.gres",
        "renders as #SBATCH --gres={'gpu': 8}",
    ),
    ("env-name", ["+cluster.env.MY-TOKEN=1"], "cluster.env.MY-TOKEN", "not an environment variable name"),
    ("lr-nan", ["optim.lr=nan"], "optim.lr", "must be a finite number"),
    ("clip-infinite", ["optim.grad_clip=inf"], "optim.grad_clip", "must be a finite number"),
    (
        "tier-interval-infinite",
        ["checkpoint.tiers.0.interval_minutes=inf"],
        "checkpoint.tiers[0].interval_minutes",
        "must be a finite number",
    ),
    ("seed-negative", ["train.seed=-1"], "train.seed", "must be in [0, 2**32)"),
    ("eps-negative", ["optim.eps=-1e-8"], "optim.eps", "must be >= 0"),
    ("init-std-negative", ["model.init_std=-0.02"], "model.init_std", "must be >= 0"),
    # issue 31: FP8 through torchao (docs/fp8.md)
    ("fp8-unknown-recipe", ["precision=bf16", "precision.fp8=delayed"], "precision.fp8", "unknown FP8 recipe"),
    (
        "fp8-on-a100",
        ["precision=bf16", "precision.fp8=tensorwise", "cluster.gpu_type=a100_80gb"],
        "precision.fp8",
        "cluster.gpu_type=a100_80gb has no FP8 tensor cores",
    ),
    (
        "fp8-with-fp16",
        ["precision=fp16", "precision.fp8=tensorwise", "cluster.gpu_type=h100_80gb"],
        "precision.dtype",
        "FP8 with fp16",
    ),
    (
        "fp8-width",
        ["model=llama_tiny", "model.d_model=136", "precision=bf16", "precision.fp8=rowwise"],
        "model.d_model",
        "d_model 136 is not a multiple of 16",
    ),
    (
        "fp8-tp-shard",
        ["model=llama_tiny", "model.ffn_hidden=336", "parallel.tp=2", "precision=bf16", "precision.fp8=tensorwise"],
        "model.ffn_hidden",
        "336 / tp 2 = 168 is not a multiple of 16",
    ),
    (
        "fp8-emulated-compile",
        ["precision=bf16", "precision.fp8=tensorwise", "parallel.compile=true"],
        "parallel.compile",
        "emulation (gpu_type=cpu) does not support torch.compile",
    ),
    ("arch-unknown", ["model.arch=lama"], "model.arch", "'lama' is not a model family"),
    # issue 32: Mixture of Experts (model.moe, parallel.ep)
    (
        "moe-keys-on-dense",
        ["model=llama_tiny", "model.moe.n_experts=8"],
        "model.moe.n_experts",
        "model.arch=llama is a dense model",
    ),
    (
        "moe-no-experts",
        ["model=moe_tiny", "model.moe.n_experts=0"],
        "model.moe.n_experts",
        "is a Mixture of Experts, but model.moe.n_experts=0",
    ),
    (
        "moe-top-k-beyond-experts",
        ["model=moe_tiny", "model.moe.top_k=9"],
        "model.moe.top_k",
        "1 to n_experts=8 experts, got top_k=9",
    ),
    ("moe-unknown-router", ["model=moe_tiny", "model.moe.router=hash"], "model.moe.router", "unknown router"),
    ("moe-groups", ["model=moe_tiny", "model.moe.n_groups=3"], "model.moe.n_groups", "must divide n_experts=8"),
    (
        "moe-negative-capacity",
        ["model=moe_tiny", "model.moe.capacity_factor=-1"],
        "model.moe.capacity_factor",
        "must be >= 0",
    ),
    (
        "moe-negative-balance",
        ["model=moe_tiny", "model.moe.balance_coef=-0.01"],
        "model.moe.balance_coef",
        "a loss coefficient must be >= 0",
    ),
    (
        "moe-negative-expert-width",
        ["model=moe_tiny", "model.moe.expert_hidden=-1"],
        "model.moe.expert_hidden",
        "expert sizes must be >= 0",
    ),
    ("moe-compile", ["model=moe_tiny", "parallel.compile=true"], "parallel.compile", "routes tokens to experts"),
    ("ep-on-dense", ["cluster.gpus_per_node=2", "zero=stage1", "parallel.ep=2"], "parallel.ep", "this model is dense"),
    (
        "experts-vs-ep",
        ["model=moe_tiny", "model.moe.n_experts=6", "cluster.gpus_per_node=4", "zero=stage1", "parallel.ep=4"],
        "parallel.ep",
        "model.moe.n_experts=6 is not divisible by ep=4",
    ),
    (
        "ep-vs-dp",
        ["model=moe_tiny", "cluster.gpus_per_node=4", "zero=stage1", "parallel.ep=3"],
        "parallel.ep",
        "ep=3 does not divide the 4 data-parallel ranks",
    ),
    ("ep-zero", ["model=moe_tiny", "parallel.ep=0"], "parallel.ep", "must be >= 1"),
    (
        "uneven-one-stage",
        ["parallel.first_stage_layers=1"],
        "parallel.first_stage_layers",
        "there is one stage (pp x virtual_stages = 1)",
    ),
    (
        "uneven-no-room",
        ["cluster.gpus_per_node=2", "parallel.pp=2", "train.micro_batch=4", "parallel.first_stage_layers=4"],
        "parallel.first_stage_layers",
        "leave 0 of model.n_layers=4 layers for the other 1 of the 2 stages",
    ),
    (
        "uneven-unequal",
        [
            "cluster.gpus_per_node=4",
            "parallel.pp=4",
            "train.micro_batch=2",
            "model.n_layers=8",
            "parallel.first_stage_layers=1",
        ],
        "parallel.first_stage_layers",
        "leave 7 of model.n_layers=8 layers for the other 3 of the 4 stages",
    ),
    ("uneven-negative", ["parallel.last_stage_layers=-1"], "parallel.last_stage_layers", "must be >= 0"),
    (
        "auto-bad-shape",
        ["model=moe_tiny", "model.n_heads=3", "parallel=auto"],
        "model.d_model",
        "not divisible by n_heads 3",
    ),  # before the search, which cannot describe such a model
    # issue 33: context parallelism (parallel.cp)
    ("cp-zero", ["parallel.cp=0"], "parallel.cp", "must be >= 1"),
    ("cp-world", ["parallel.cp=2", "parallel.dp=2"], "parallel.dp", "dp x tp x pp x cp = 2 x 1 x 1 x 2 = 4 GPUs"),
    ("cp-vs-seq", ["parallel.cp=2", "train.seq_len=126"], "train.seq_len", "cannot be cut into 2 x cp = 4 equal"),
    ("cp-dropout", ["parallel.cp=2", "model.dropout=0.1"], "model.dropout", "0.1 with cp=2"),
    ("cp-moe", ["model=moe_tiny", "parallel.cp=2"], "parallel.cp", "is a Mixture-of-Experts model"),
    (
        "cp-with-ep",
        ["model=moe_tiny", "cluster.gpus_per_node=4", "zero=stage1", "parallel.ep=2", "parallel.cp=2"],
        "parallel.cp",
        "with expert parallelism (ep=2) is not supported",
    ),
    ("cp-compile", ["parallel.cp=2", "parallel.compile=true"], "parallel.compile", "with cp=2"),
]

# cluster.container (hpctrain/checks/container.py): on Slurm, with an image that works unless a case breaks it
PYXIS = ["cluster=dev", "cluster.container.runtime=pyxis", "cluster.container.image='nvcr.io#nvidia/pytorch:24.05-py3'"]
APPTAINER = ["cluster=dev", "cluster.container.runtime=apptainer", "cluster.container.image=/shared/pytorch.sif"]
BAD += [
    (
        "container-relative-sif",
        [*APPTAINER, "cluster.container.image=images/pytorch.sif"],
        "cluster.container.image",
        "is a relative path",
    ),
    (
        "container-relative-sqsh",
        [*PYXIS, "cluster.container.image=./pytorch.sqsh"],
        "cluster.container.image",
        "pyxis reads a squashfs file at its path",
    ),
    (
        "container-sif-on-pyxis",
        [*PYXIS, "cluster.container.image=/shared/pytorch.sif"],
        "cluster.container.image",
        "is an Apptainer image",
    ),
    (
        "container-registry-without-hash",
        [*PYXIS, "cluster.container.image=nvcr.io/nvidia/pytorch:24.05-py3"],
        "cluster.container.image",
        "separates the registry from the image with '#'",
    ),
    (
        "container-without-image",
        ["cluster=dev", "cluster.container.runtime=pyxis"],
        "cluster.container.image",
        "needs an image",
    ),
    (
        "container-image-without-runtime",
        ["cluster=dev", "cluster.container.image=/shared/pytorch.sif"],
        "cluster.container.image",
        "cluster.container.runtime=none",
    ),
    (
        "container-on-local",
        ["cluster.container.runtime=apptainer", "cluster.container.image=/shared/pytorch.sif"],
        "cluster.container.runtime",
        "cluster.executor=local runs them as processes of this machine",
    ),
    (
        "container-mount-one-path",
        [*PYXIS, "cluster.container.mounts=[/data]"],
        "cluster.container.mounts[0]",
        "is not host_path:container_path",
    ),
    (
        "container-mount-relative",
        [*PYXIS, "cluster.container.mounts=[data:/data]"],
        "cluster.container.mounts[0]",
        "the host path 'data'",
    ),
    (
        "container-mount-flags",
        [*APPTAINER, "cluster.container.mounts=[/data:/data:ro+rprivate]"],
        "cluster.container.mounts[0]",
        "apptainer takes ro or rw",
    ),
    (
        "container-workdir-relative",
        [*PYXIS, "cluster.container.workdir=work"],
        "cluster.container.workdir",
        "is relative",
    ),
    (
        "container-env-value",
        [*PYXIS, "cluster.container.env=['HF_TOKEN=abc']"],
        "cluster.container.env[0]",
        "not an environment variable name",
    ),
    (
        "container-cleanenv",
        [*APPTAINER, "cluster.container.args=[--cleanenv]"],
        "cluster.container.args",
        "without the host's environment",
    ),
]


@pytest.mark.parametrize("overrides,key,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_rejected_before_submission(
    compose_cfg, capsys, tmp_path: Path, overrides: list[str], key: str, words: str
) -> None:
    cfg = compose_cfg(*overrides, f"run.root={tmp_path}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "nothing was submitted" in err
    assert f"{key}: " in err and words in err, err
    assert "fix: " in err
    assert not any(tmp_path.iterdir()), "a rejected config must leave nothing behind"


def test_the_suite_is_broad() -> None:
    assert len({c[0] for c in BAD}) >= 20
    assert len({c[2] for c in BAD}) >= 20, "distinct keys"


def test_all_errors_are_reported_at_once(compose_cfg, capsys, tmp_path: Path) -> None:
    cfg = compose_cfg("optim.lr=0", "precision=fp16", "precision.loss_scaling=false", f"run.root={tmp_path}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "2 config error(s)" in err and "optim.lr" in err and "precision.loss_scaling" in err


# Schema-level mistakes through the real command line, reported by hpctrain (hpctrain/config/compose_errors.py),
# not by Hydra: (overrides, key named, words in stderr)
SCHEMA = [
    (["model.n_layer=3"], "model.n_layer", "did you mean model.n_layers?"),  # a typo of model.n_layers
    (["parallel.tp=two"], "parallel.tp", "takes an integer, got 'two'"),  # not an int
    (["model=gpt5"], "model", "'gpt5' is not an option of model"),  # no such model: the options listed
    (["precision.dtype=fp8"], "precision.dtype", "'fp8' is not one of fp32, bf16, fp16"),  # not a precision
    (["plan.simulate_device=gpu"], "plan.simulate_device", "did you mean plan.simulate_device=cuda?"),
    (["+model.n_layer=3"], "model.n_layer", "did you mean model.n_layers?"),  # added with +: hpctrain's own check
    (["train.max_steps=1e20"], "train.max_steps", "takes an integer"),  # a float; 10**20 itself: max-steps-overflow
    (["model.arch=lama"], "model.arch", "did you mean model.arch=llama?"),  # a family's name mistyped
]


@pytest.mark.parametrize("overrides,key,words", SCHEMA, ids=[s[0][0] for s in SCHEMA])
def test_schema_rejects_typos_and_types(tmp_path: Path, overrides: list[str], key: str, words: str) -> None:
    proc = run_hpctrain(*overrides, f"run.root={tmp_path}", cwd=tmp_path, timeout=60)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    assert "nothing was submitted" in proc.stderr and f"  - {key}: " in proc.stderr, proc.stderr
    assert words in proc.stderr and "    fix: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not any(tmp_path.iterdir()), "a refused command line leaves nothing behind"


def test_config_error_exit_code_on_the_command_line(tmp_path: Path) -> None:
    proc = run_hpctrain("parallel.dp=3", f"run.root={tmp_path}", cwd=tmp_path, timeout=60)
    assert proc.returncode == EXIT_CONFIG_ERROR
    assert "parallel.dp: dp x tp x pp = 3 x 1 x 1 = 3 GPUs" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_llama_tiny_passes_the_checks(compose_cfg) -> None:
    """The model checks accept the Llama they were written for; a missing init_from only warns on a dry run."""
    from hpctrain.checks.runner import check_config

    check_config(compose_cfg("model=llama_tiny", "parallel.tp=2"))
    report = check_config(compose_cfg("model=llama_tiny", "model.init_from=/nonexistent/x", "dry_run=true"))
    assert [w.key for w in report.warnings if "does not exist" in w.message] == ["model.init_from"]


def test_sequence_parallel_without_tp_is_off_with_a_warning(compose_cfg) -> None:
    """Megatron's rule: an experiment with SP on, overridden to tp=1, runs without SP (there is no TP group)."""
    from hpctrain.checks.runner import check_config
    from hpctrain.config.layout import resolve_layout

    cfg = compose_cfg("parallel.sequence_parallel=true")
    report = check_config(cfg)
    assert [w.key for w in report.warnings if "ignored with tp=1" in w.message] == ["parallel.sequence_parallel"]
    assert (
        not resolve_layout(cfg).sequence_parallel
        and resolve_layout(compose_cfg("parallel.sequence_parallel=true", "parallel.tp=2")).sequence_parallel
    )


def test_warnings_carry_the_computed_bubble(compose_cfg) -> None:
    from hpctrain.checks.runner import check_config

    report = check_config(compose_cfg("+experiment=175b", "dry_run=true"))
    bubble = [w for w in report.warnings if w.key == "train.grad_accum"]
    assert bubble and "36.8%" in bubble[0].message  # (p-1)/(m+p-1) = 7/19


@pytest.mark.parametrize("key", ["cluster.partition", "cluster.account", "run.name"])
def test_a_newline_never_reaches_the_sbatch_script(compose_cfg, capsys, tmp_path: Path, key: str) -> None:
    from omegaconf import OmegaConf

    cfg = compose_cfg("cluster.partition=gpu", f"run.root={tmp_path}")
    OmegaConf.update(cfg, key, "gpu\n#SBATCH --exclusive")  # would be a line of its own in the script
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"{key}: " in err and "control character" in err, err
    assert not any(tmp_path.iterdir())


def test_setup_lines_may_hold_what_a_shell_line_holds(compose_cfg) -> None:
    from hpctrain.checks.runner import check_config

    check_config(compose_cfg("cluster.partition=gpu", "cluster.setup=['module load cuda\tnccl']"))


def test_warmup_longer_than_the_run_is_a_warning_and_the_run_trains(compose_cfg, tmp_path: Path) -> None:
    """`python -m hpctrain train.max_steps=10` with the default 30 warmup steps: a trial run, not an error."""
    from hpctrain.checks.runner import check_config
    from hpctrain.train.lr_schedule import lr_at

    report = check_config(compose_cfg("train.max_steps=10"))
    assert [w.key for w in report.warnings if "warmup" in w.message] == ["optim.warmup_steps"]
    cfg = compose_cfg("train.max_steps=10")
    lrs = [lr_at(step, cfg.optim, 10) for step in range(10)]
    assert lrs == sorted(lrs) and 0 < lrs[-1] < cfg.optim.lr  # still ramping up at the end
    proc = run_hpctrain("train.max_steps=10", f"run.root={tmp_path}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 10/10" in proc.stdout and "warning: optim.warmup_steps" in proc.stderr


def test_a_run_name_that_leaves_run_root_creates_nothing_anywhere(tmp_path: Path) -> None:
    """`run.name='../../up'` put a real run's directory two levels above run.root; refused on the command line."""
    root = tmp_path / "a" / "b" / "root"
    root.mkdir(parents=True)
    for bad in ("run.name=../../up", "run.id=../../../escape"):
        proc = run_hpctrain(bad, f"run.root={root}", cwd=tmp_path, timeout=60)
        assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
        assert bad.split("=")[0] + ": " in proc.stderr and "fix: " in proc.stderr
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [
            Path("a"),
            Path("a/b"),
            Path("a/b/root"),
        ]


def test_a_symbolic_link_out_of_run_root_is_refused(compose_cfg, tmp_path: Path) -> None:
    from hpctrain.checks.runner import run_checks

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / "linked").symlink_to(elsewhere)
    report = run_checks(compose_cfg(f"run.root={root}", "run.name=linked"))
    assert [p.key for p in report.errors] == ["run.name"] and "symbolic link" in report.errors[0].message


def test_a_resume_by_path_may_name_a_run_outside_run_root(compose_cfg, tmp_path: Path) -> None:
    """run.resume=PATH names an existing run wherever it is: no run.name/run.id rule applies to it."""
    from hpctrain.checks.runner import run_checks

    report = run_checks(compose_cfg(f"run.root={tmp_path / 'root'}", f"run.resume={tmp_path / 'other' / 'run'}"))
    assert not [p for p in report.errors if p.key.startswith("run.")]


def test_a_nan_reports_once_per_key_and_with_the_rest(compose_cfg, capsys, tmp_path: Path) -> None:
    cfg = compose_cfg("optim.lr=nan", "cluster.signal_delay_s=-5", "train.seed=-1", f"run.root={tmp_path}")
    assert run(cfg).code == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "3 config error(s)" in err and err.count("optim.lr: ") == 1


def test_fp8_on_a_gpu_without_compile_warns_that_it_is_slower_than_bf16(compose_cfg) -> None:
    """torchao's FP8 eager runs its casts and scales as kernels of their own: slower than bf16 (issue 45, S3)."""
    from hpctrain.checks.runner import check_config

    fp8 = ("+experiment=llama3_8b_4node", "data=synthetic", "precision.fp8=tensorwise")
    eager = check_config(compose_cfg(*fp8, "parallel.compile=false"))
    assert not eager.errors
    slow = [w for w in eager.warnings if w.key == "parallel.compile"]
    assert len(slow) == 1 and "slower" in slow[0].message and slow[0].fix.startswith("set parallel.compile=true")
    compiled = check_config(compose_cfg(*fp8, "parallel.compile=true"))
    assert not [w for w in compiled.warnings if w.key == "parallel.compile"]
