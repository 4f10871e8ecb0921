"""Every command in the README is run by a test (issue 34): the README's code blocks are extracted, and each command
in them is either run here, for real, or named by an existing test that runs it; a command with neither fails.

What counts as a command: every line of a fenced `bash`/`sh` block (backslash continuations joined, comments
dropped, `&&` and `;` separating commands) and every `$ ` line of another fenced block. A command is compared
as the shell reads it (quotes removed, spaces collapsed).

Run here (cheap, under a minute in all): `--help`, the 175B dry run, the two submissions (to an `sbatch` that
only answers with a job id), a resume and the status page of the submitted run, the sweep's points composed
and checked (`dry_run=true`: the sweep itself submits on Slurm, tests/slurm). Named: the install and test
commands (what .ci/run runs on a fresh machine, checked below), the default local run (tests/e2e), the example
error (tests/launch/test_login_errors.py). Each named test must exist and contain the text that shows it
runs that command, so a rename or a rewrite that drops it fails here too.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import stat
from pathlib import Path

import pytest

from tests.conftest import run_hpctrain

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 170
RUN_ID = "20261130-101500-ab12cd34"  # the README's example run id; the tests below use the submitted run's

# README command -> where it is run: this file's test that runs it for real, or existing tests that do (node id,
# and a text of that test's source that shows it runs the command).
HELP = "python -m hpctrain --help"
DRY_RUN = "python -m hpctrain +experiment=175b dry_run=true"
SUBMIT_175B = "python -m hpctrain +experiment=175b"
SUBMIT = "python -m hpctrain +experiment=gpt3_1.3b_1node cluster.partition=gpu cluster.account=llm"
RESUME = f"python -m hpctrain run.resume={RUN_ID}"
SWEEP = "python -m hpctrain -m optim.lr=1e-4,3e-4,1e-3"
STATUS = f"python -m hpctrain.status {RUN_ID}"

RUN_HERE = {
    HELP: "test_help",
    DRY_RUN: "test_dry_run",
    SUBMIT_175B: "test_submit_175b",
    SUBMIT: "test_submit",
    RESUME: "test_resume",
    SWEEP: "test_sweep_points_are_composed_and_checked",
    STATUS: "test_status",
}
CI = "tests/test_readme.py::test_ci_installs_and_tests_as_the_readme_says"
NAMED: dict[str, list[tuple[str, str]]] = {
    # .ci/run, on a fresh machine: the same torch pin, the package with its test extra (a superset of `-e .`)
    "pip install torch==2.13.0 -e .": [(CI, "pip install")],
    "pip install torch==2.13.0 -e .[test]": [(CI, "pip install")],
    "WANDB_MODE=offline python -m pytest": [(CI, "WANDB_MODE=offline")],
    "python -m hpctrain": [
        ("tests/e2e/test_local_run.py::test_default_command_trains_the_tiny_gpt", 'run_hpctrain(f"run.root={tmp_path}"')
    ],
    "python -m hpctrain parallel.dp=3": [
        (
            "tests/launch/test_login_errors.py::"
            "test_the_readme_example_error_is_what_the_command_prints_and_its_fix_is_valid",
            '"parallel.dp=3"',
        )
    ],
    # Run here too; and by the tests that run them on the real (dev) Slurm cluster or to the end
    SUBMIT_175B: [("tests/test_login_node.py::test_slurm_submission_imports_no_torch", '"+experiment=175b"')],
    RESUME: [("tests/e2e/test_local_run.py::test_resume_continues_in_the_same_directory", '"run.resume=')],
    SWEEP: [
        (
            "tests/slurm/test_hpctrain_on_slurm.py::test_a_sweep_submits_one_job_per_point_and_returns",
            '"optim.lr=1e-3,2e-3,3e-3"',
        ),
        ("tests/launch/test_sweep_checks.py::test_one_bad_point_stops_the_sweep_before_any_point_runs", '"-m"'),
    ],
    "python -m hpctrain +experiment=175b recovery=replicas recovery.groups=4 cluster.spare_nodes=2": [
        (
            "tests/replicas/test_replicas_config.py::test_the_readme_command_plans_four_groups_of_the_175b_layout",
            "README_COMMAND.split()",
        )
    ],
    STATUS: [
        (
            "tests/tools/test_status_cli.py::test_the_page_the_json_and_watch_on_a_finished_run",
            'module="hpctrain.status"',
        )
    ],
}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text: (language, body)."""
    return re.findall(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.M | re.S)


def commands(text: str) -> list[str]:
    """Every command in the text's code blocks, as the shell reads it (see the module's docstring)."""
    found = []
    for lang, body in code_blocks(text):
        body = body.replace("\\\n", " ")
        if lang in ("bash", "sh", "shell", "console"):
            lines = body.splitlines()
        else:
            lines = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
        for line in lines:
            words: list[str] = []
            for word in shlex.split(line, comments=True) + [";"]:
                if word in ("&&", "||", ";", "|"):
                    if words:
                        found.append(" ".join(words))
                    words = []
                elif word.endswith(";"):
                    words.append(word[:-1])
                    found.append(" ".join(words))
                    words = []
                else:
                    words.append(word)
    return found


def uncovered(text: str) -> list[str]:
    return [c for c in commands(text) if c not in RUN_HERE and c not in NAMED]


def test_every_readme_command_is_run_or_named_by_a_test() -> None:
    readme = README.read_text()
    found = commands(readme)
    assert len(found) >= len(RUN_HERE), found  # the extraction found the README's blocks
    assert uncovered(readme) == [], (
        "README commands that no test runs: add a test to RUN_HERE or NAMED in "
        f"tests/test_readme.py: {uncovered(readme)}"
    )
    stale = sorted((set(RUN_HERE) | set(NAMED)) - set(found))
    assert stale == [], f"in tests/test_readme.py but no longer in the README: {stale}"


def test_a_new_command_without_a_test_is_caught() -> None:
    readme = README.read_text()
    added = readme + "\n```bash\npython -m hpctrain +experiment=llama3_8b_4node  # new\nls && hpctrain-foo\n```\n"
    assert uncovered(added) == ["python -m hpctrain +experiment=llama3_8b_4node", "ls", "hpctrain-foo"]
    assert uncovered(readme + "\n```\n$ python tools/goodput.py --png g.png\nsome output\n```\n") == [
        "python tools/goodput.py --png g.png"
    ]


def _function(path: Path, name: str) -> ast.AST | None:
    tree = ast.parse(path.read_text())
    *classes, func = name.split("::")
    scope: list[ast.stmt] = tree.body
    for cls in classes:
        scope = next((n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == cls), [])
    return next((n for n in scope if isinstance(n, ast.FunctionDef) and n.name == func), None)


def test_the_named_tests_exist_and_run_their_command() -> None:
    here = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert set(RUN_HERE.values()) <= here, set(RUN_HERE.values()) - here
    for command, tests in NAMED.items():
        for node_id, evidence in tests:
            file, _, name = node_id.partition("::")
            assert (REPO / file).is_file(), f"{command}: {file} does not exist"
            func = _function(REPO / file, name)
            assert func is not None, f"{command}: no test {node_id}"
            source = ast.get_source_segment((REPO / file).read_text(), func) or ""
            assert evidence in source, f"{command}: {node_id} no longer contains {evidence!r}"


def test_ci_installs_and_tests_as_the_readme_says() -> None:
    """.ci/run, on a clean clone on a fresh machine, runs the README's install and test commands: the same torch
    pin, the package with its test extra, WANDB_MODE=offline, the whole pytest suite."""
    readme, ci = README.read_text(), (REPO / ".ci" / "run").read_text()
    pins = set(re.findall(r"torch==[\d.]+", readme))
    assert len(pins) == 1 and f"pip install -q {pins.pop()}" in ci
    assert "pip install -q -e '.[test]'" in ci and "pip install torch==2.13.0 -e '.[test]'" in readme
    assert re.search(r"^export .*\bWANDB_MODE=offline\b", ci, re.M)
    assert re.search(r"^python3 -m pytest( -q| --durations=\d+)*$", ci, re.M)  # the whole suite, no selection
    assert "test = [" in (REPO / "pyproject.toml").read_text()


def test_ci_runs_the_checks_the_readme_names() -> None:
    """The README's lint, format, type and import checks are each run by .ci/run, whose failure is recorded and
    fails the run after the tests; the test extra installs the tools."""
    readme, ci = README.read_text(), (REPO / ".ci" / "run").read_text()
    paragraph = next(p for p in readme.split("\n\n") if p.startswith("CI (`.ci/run`)"))
    checks = re.findall(r"`((?:ruff|mypy|lint-imports)[^`]*)`", paragraph)
    assert len(checks) == 4, paragraph
    for check in checks:
        assert re.search(rf"^(python3 -m )?{re.escape(check)} \|\| failed\+=", ci, re.M), check
    assert re.search(r"^if \(\( \$\{#failed\[@\]\} \)\); then$", ci, re.M) and "    exit 1" in ci
    extra = (REPO / "pyproject.toml").read_text().split("test = [", 1)[1].split("]\n", 1)[0]
    assert all(f'"{tool}>=' in extra for tool in ("ruff", "mypy", "import-linter")), extra


def test_readme_is_short_and_its_docs_links_exist() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) < MAX_LINES
    mentioned = set(re.findall(r"\bdocs/[\w./-]+\.md\b", readme))
    assert mentioned and all((REPO / m).is_file() for m in mentioned), [
        m for m in mentioned if not (REPO / m).is_file()
    ]
    table = set(re.findall(r"^\| \[[\w.]+\]\((docs/[\w.]+\.md)\) \|", readme, re.M))
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages <= table, f"docs pages missing from the README's table: {sorted(pages - table)}"


def _args(command: str) -> tuple[str, list[str]]:
    """`python -m MODULE ARGS...` -> (MODULE, ARGS)."""
    python, dash_m, module, *args = shlex.split(command)
    assert (python, dash_m) == ("python", "-m"), command
    return module, args


@pytest.fixture(scope="module")
def slurm_login(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A working directory on a login node whose Slurm only answers: `sbatch` with a job id, `srun` (submitit
    looks for it), `sacct` with nothing (no accounting)."""
    cwd = tmp_path_factory.mktemp("login")
    bin_dir = cwd / "bin"
    bin_dir.mkdir()
    for name, text in {"sbatch": "echo 'Submitted batch job 4242'", "srun": "exit 0", "sacct": "exit 1"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    return cwd, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _submitted_run_dir(stdout: str) -> Path:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("run directory: "), stdout[-2000:]
    return Path(last.removeprefix("run directory: "))


@pytest.fixture(scope="module")
def submitted(slurm_login: tuple[Path, dict[str, str]]) -> Path:
    """The README's submission, run: the experiment's dataset is a site path, so synthetic data stands in."""
    cwd, env = slurm_login
    module, args = _args(SUBMIT)
    proc = run_hpctrain(*args, "data=synthetic", module=module, cwd=cwd, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "submitted job 4242" in proc.stdout
    return _submitted_run_dir(proc.stdout)


def test_help(tmp_path: Path) -> None:
    module, args = _args(HELP)
    proc = run_hpctrain(*args, module=module, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "+experiment=175b" in proc.stdout, proc.stderr[-2000:]


def test_dry_run(tmp_path: Path) -> None:
    module, args = _args(DRY_RUN)
    proc = run_hpctrain(*args, f"run.root={tmp_path / 'runs'}", module=module, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DP 64 x TP 8 x PP 8" in proc.stdout and "#SBATCH --nodes=512" in proc.stdout
    assert not any(tmp_path.iterdir())  # nothing created


def test_submit(submitted: Path, slurm_login: tuple[Path, dict[str, str]]) -> None:
    cwd, _ = slurm_login
    assert submitted.parent.parent == cwd / "outputs" and (submitted / "config.yaml").is_file()
    assert "4242" in (submitted / "jobs.jsonl").read_text()


def test_submit_175b(tmp_path: Path, slurm_login: tuple[Path, dict[str, str]]) -> None:
    _, env = slurm_login
    module, args = _args(SUBMIT_175B)
    proc = run_hpctrain(
        *args, "data=synthetic", f"run.root={tmp_path}", module=module, cwd=tmp_path, env=env, timeout=120
    )
    assert proc.returncode == 0 and "submitted job 4242" in proc.stdout, proc.stderr[-3000:]
    assert _submitted_run_dir(proc.stdout).parent.parent == tmp_path


def test_resume(submitted: Path, slurm_login: tuple[Path, dict[str, str]]) -> None:
    cwd, env = slurm_login
    module, args = _args(RESUME.replace(RUN_ID, submitted.name))
    proc = run_hpctrain(*args, module=module, cwd=cwd, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _submitted_run_dir(proc.stdout) == submitted  # the same run, the same directory
    assert len((submitted / "jobs.jsonl").read_text().splitlines()) == 2


def test_status(submitted: Path, slurm_login: tuple[Path, dict[str, str]]) -> None:
    cwd, env = slurm_login
    module, args = _args(STATUS.replace(RUN_ID, submitted.name))
    proc = run_hpctrain(*args, module=module, cwd=cwd, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run {submitted.name}" in proc.stdout and "goodput" in proc.stdout


def test_sweep_points_are_composed_and_checked(tmp_path: Path) -> None:
    """The sweep as written, each point a dry run: composed, checked and planned (tests/slurm submits it)."""
    module, args = _args(SWEEP)
    proc = run_hpctrain(*args, "dry_run=true", module=module, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "sweep: 3 points" in proc.stdout
    for lr in ("0.0001", "0.0003", "0.001"):
        assert f"optim.lr={lr} " in proc.stdout
