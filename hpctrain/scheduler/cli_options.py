"""Runtime options read the way the runtime reads them: `apptainer exec`'s, and srun's (with pyxis' `--container-*`).

The checks (hpctrain/checks/container.py) judge what an option means, not how it is spelled: `-e`,
`--cleanenv`, `--cleanenv=true`, `-e=1` and the `e` of `-ceC` are one option to Apptainer, and `--cleanenv=false`
turns it off again. So the words of `cluster.container.args` and `cluster.srun_args` are parsed here with each
program's own rules:

- `apptainer` is a Go program whose command line is cobra/pflag: `--name`, `--name=value`, `--name value` for an
  option that takes a value, `-x`, shorthands combined (`-ceC`), a shorthand's value attached (`-B/a:/b`) or after
  `=` (`-e=false`); a boolean option takes no next word, only `=value` (strconv.ParseBool's spellings); no
  abbreviations; the first word that is not an option ends the options (`SetInterspersed(false)`), so it would be
  the image;
- `srun` uses glibc's getopt_long with a leading `+` in its short options: `--name=value` or `--name value` for a
  required value, `--name=value` only for an optional one, any unambiguous prefix of a long name (`--exp=NONE` is
  `--export=NONE`), `-n4` and `-n 4`; the first word that is not an option is the command.

The tables are the programs' own: Apptainer's `cmd/internal/cli/action_flags.go` (the flags registered for `exec`,
with the few older releases had), Slurm's `src/common/slurm_opt.c` (the options srun takes), pyxis' `args.c`.
An option not in them is reported as unknown (a warning: another release, or another SPANK plugin, may have it).
"""

from __future__ import annotations

from dataclasses import dataclass

NONE, REQUIRED, OPTIONAL = 0, 1, 2  # the value an option takes (getopt's has_arg); pflag's booleans are NONE

# apptainer exec: name[/shorthand], `=` when it takes a value; the others are booleans (pflag's NoOptDefVal "true")
APPTAINER_EXEC = """
add-caps= allow-setuid app= apply-cgroups= authfile= bind=/B blkio-weight= blkio-weight-device= cdi-dirs= cleanenv/e
compat compat32 contain/c containall/C containlibs= cpu-shares= cpus= cpuset-cpus= cpuset-mems= cwd= device=
disable-cache dns= docker-host= docker-login docker-password= docker-username= drop-caps= env= env-file= fakeroot/f
fusemount= home=/H hostname= ignore-fakeroot-command ignore-subuid ignore-userns intel-hpu ipc/i keep-privs memory=
memory-reservation= memory-swap= mount= net/n netns-path= network= network-args= no-env= no-eval no-home no-https
no-init no-mount= no-nv no-pid no-privs no-rocm no-umask nohttps nv nvccli oom-kill-disable overlay=/o passphrase
pem-path= pid/p pids-limit= pwd= rocm scratch=/S security= sharens tmpdir= underlay unsquash userns/u uts workdir=/W
writable/w writable-tmpfs
dmtcp-launch= dmtcp-restart= vm vm-cpu= vm-err vm-ip= vm-ram=
"""  # the last line: options of older releases (1.0 to 1.2)

# srun (Slurm 25.x): `=` a required value, `[=]` an optional one (attached only), neither: none
SRUN = """
accel-bind= account=/A acctg-freq= async autocomplete= bcast[=] bcast-exclude= begin=/b bb= bbf= cluster-constraint=
chdir=/D cluster= clusters=/M comment= compress[=] consolidate-segments container= container-id= context= contiguous
constraint=/C core-spec=/S cores-per-socket= cpu-bind= cpu_bind= cpu-freq= cpus-per-gpu= cpus-per-task=/c deadline=
debugger-test delay-boot= dependency=/d disable-status/X distribution=/m epilog= error=/e exact exclude=/x
exclusive[=] export= external-launcher[=] extra= extra-node-info=/B gpu-bind= gpu-freq= gpus=/G gpus-per-node=
gpus-per-socket= gpus-per-task= gres= gres-flags= help/h het-group= hint= hold/H ignore-signals= immediate[=]/I
input=/i interactive jobid= job-name=/J kill-on-bad-exit[=]/K label/l licenses=/L mail-type= mail-user= threads=/T
mcs-label= mem= mem-bind= mem-per-cpu= mem-per-gpu= mem-update= mincpus= mpi= msg-timeout= multi-prog network=
nice[=] no-allocate/Z no-kill[=]/k nodefile=/F nodelist=/w nodes=/N ntasks=/n ntasks-per-core= ntasks-per-gpu=
ntasks-per-node= ntasks-per-socket= ntasks-per-tres= oom-kill-step[=] open-mode= output=/o overcommit/O overlap[=]
oversubscribe/s pack-group= parsable partition=/p prefer= preserve-env/E priority= profile= prolog= propagate[=]
pty[=] qos=/q quiet/Q quit-on-interrupt reboot relative=/r resources= reservation= resv-ports[=] runtime= segment=
send-libs[=] signal= slurmd-debug= sockets-per-node= spread-job spread-segments stepmgr switches= task-epilog=
task-prolog= tasks-per-node= test-only thread-spec= threads-per-core= time=/t time-min= tmp= treewidth= tres-bind=
tres-per-task= unbuffered/u use-min-nodes verbose/v version/V usage wait=/W wait-for-children wckey= whole x11[=]
"""
# pyxis' SPANK options, which srun takes as its own long options when the plugin is installed
PYXIS = """
container-image= container-mounts= container-workdir= container-name= container-save= container-mount-home
no-container-mount-home container-remap-root no-container-remap-root container-entrypoint no-container-entrypoint
container-entrypoint-log container-writable container-readonly container-env= container-unshare=
"""
# one option under two names (the same `val` in Slurm's table): getopt_long finds no ambiguity between them
SRUN_ALIASES = {"cpu_bind": "cpu-bind", "tasks-per-node": "ntasks-per-node", "pack-group": "het-group"}

PFLAG_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool
PFLAG_FALSE = ("0", "f", "F", "FALSE", "false", "False")


@dataclass(frozen=True)
class Flag:
    name: str
    takes: int = NONE
    short: str = ""


def _table(text: str) -> dict[str, Flag]:
    flags = {}
    for word in text.split():
        spec, _, short = word.partition("/")
        takes = OPTIONAL if spec.endswith("[=]") else REQUIRED if spec.endswith("=") else NONE
        name = spec.removesuffix("[=]").removesuffix("=")
        flags[name] = Flag(name, takes, short)
    return flags


APPTAINER_FLAGS = _table(APPTAINER_EXEC)
SRUN_FLAGS = {**_table(SRUN), **_table(PYXIS)}


@dataclass(frozen=True)
class Word:
    """One meaning on the command line. `kind`: "option" (`name` the long name, `value` its value: the one given,
    "true" for a boolean without one, None for an srun option without one), "unknown" (no such option),
    "positional" (not an option: the runtime would take it as the image or the command), "missing" (an option
    whose value is not there: the runtime would take the next word hpctrain writes), "invalid" (the runtime refuses
    it: a boolean's value that is not one, a value given to an option that takes none, an ambiguous abbreviation).
    `written`: the word(s) as written, `index` the position of the first in the list."""

    kind: str
    written: str
    index: int
    name: str = ""
    value: str | None = None
    why: str = ""


def _unknown(words: list[str], i: int, written: str, has_value: bool) -> tuple[Word, int]:
    """An option the table lacks: when it has no `=value`, a next word that is not an option is taken as its value
    (it may take one: no word is reported as the image on a guess)."""
    if not has_value and i < len(words) and not words[i].startswith("-"):
        return Word("unknown", f"{written} {words[i]}", i - 1), i + 1
    return Word("unknown", written, i - 1), i


def _rest(words: list[str], start: int) -> list[Word]:
    return [Word("positional", word, start + n) for n, word in enumerate(words[start:])]


def parse_apptainer(words: list[str]) -> list[Word]:
    """`apptainer exec`'s options as pflag parses them, in order (see the module docstring)."""
    out: list[Word] = []
    by_short = {f.short: f for f in APPTAINER_FLAGS.values() if f.short}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            return [*out, *_rest(words, i)]
        if not word.startswith("-") or word == "-":
            return [*out, *_rest(words, i - 1)]
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            if not name or name.startswith(("-", "=")):
                out.append(Word("invalid", word, i - 1, why="bad flag syntax"))
                continue
            flag = APPTAINER_FLAGS.get(name)
            if flag is None:
                unknown, i = _unknown(words, i, word, bool(eq))
                out.append(unknown)
            elif flag.takes == NONE:
                out.append(_boolean(flag, value if eq else "true", word, i - 1))
            elif eq:
                out.append(Word("option", word, i - 1, name, value))
            elif i < len(words):  # the next word, whatever it is
                out.append(Word("option", f"{word} {words[i]}", i - 1, name, words[i]))
                i += 1
            else:
                out.append(Word("missing", word, i - 1, name))
            continue
        chars = word[1:]
        while chars:
            flag = by_short.get(chars[0])
            if flag is None:
                out.append(Word("unknown", word, i - 1, why=f"no shorthand -{chars[0]}"))
                break
            if len(chars) > 2 and chars[1] == "=":
                value, chars = chars[2:], ""
            elif flag.takes == NONE:
                value, chars = "true", chars[1:]
            elif len(chars) > 1:
                value, chars = chars[1:], ""
            elif i < len(words):
                value, chars = words[i], ""
                i += 1
            else:
                out.append(Word("missing", word, i - 1, flag.name))
                break
            out.append(
                _boolean(flag, value, word, i - 1)
                if flag.takes == NONE
                else Word("option", word, i - 1, flag.name, value)
            )
    return out


def _boolean(flag: Flag, value: str, written: str, index: int) -> Word:
    if value in PFLAG_TRUE:
        return Word("option", written, index, flag.name, "true")
    if value in PFLAG_FALSE:
        return Word("option", written, index, flag.name, "false")
    return Word("invalid", written, index, flag.name, value, why=f"{value!r} is not a boolean (true or false)")


def _long_srun(name: str) -> tuple[Flag | None, str]:
    """getopt_long's lookup: the exact name, else the one option a prefix names; (None, why) otherwise."""
    if name in SRUN_FLAGS:
        flag = SRUN_FLAGS[name]
    else:
        found = {SRUN_ALIASES.get(n, n) for n in SRUN_FLAGS if n.startswith(name)}
        if len(found) > 1:
            shown = ", ".join(f"--{n}" for n in sorted(found)[:4])
            return None, f"ambiguous: --{name} abbreviates {shown}{'...' if len(found) > 4 else ''}"
        if not found:
            return None, ""
        flag = SRUN_FLAGS[found.pop()]
    return SRUN_FLAGS[SRUN_ALIASES.get(flag.name, flag.name)], ""


def parse_srun(words: list[str]) -> list[Word]:
    """srun's options (pyxis' included) as getopt_long parses them, in order (see the module docstring)."""
    out: list[Word] = []
    by_short = {f.short: f for f in SRUN_FLAGS.values() if f.short}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            return [*out, *_rest(words, i)]
        if not word.startswith("-") or word == "-":
            return [*out, *_rest(words, i - 1)]
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            flag, why = _long_srun(name)
            if flag is None and why:
                out.append(Word("invalid", word, i - 1, why=why))
            elif flag is None:
                unknown, i = _unknown(words, i, word, bool(eq))
                out.append(unknown)
            elif flag.takes == NONE and eq:
                out.append(Word("invalid", word, i - 1, flag.name, value, why=f"--{flag.name} takes no value"))
            elif eq or flag.takes != REQUIRED:
                out.append(Word("option", word, i - 1, flag.name, value if eq else None))
            elif i < len(words):
                out.append(Word("option", f"{word} {words[i]}", i - 1, flag.name, words[i]))
                i += 1
            else:
                out.append(Word("missing", word, i - 1, flag.name))
            continue
        chars = word[1:]
        while chars:
            flag = by_short.get(chars[0])
            if flag is None:
                out.append(Word("unknown", word, i - 1, why=f"no option -{chars[0]}"))
                break
            if flag.takes == NONE:
                out.append(Word("option", word, i - 1, flag.name))
                chars = chars[1:]
                continue
            if len(chars) > 1 or flag.takes == OPTIONAL:
                out.append(Word("option", word, i - 1, flag.name, chars[1:] or None))
            elif i < len(words):
                out.append(Word("option", f"{word} {words[i]}", i - 1, flag.name, words[i]))
                i += 1
            else:
                out.append(Word("missing", word, i - 1, flag.name))
            break
    return out


def final(words: list[Word], name: str) -> Word | None:
    """The option's last occurrence: both parsers keep the last value of an option given twice."""
    found = [w for w in words if w.kind == "option" and w.name == name]
    return found[-1] if found else None


def values(words: list[Word], name: str) -> list[tuple[Word, str]]:
    """Each comma-separated item of every occurrence of a list option (`--no-env A,B --no-env C`)."""
    return [
        (w, item)
        for w in words
        if w.kind == "option" and w.name == name and w.value
        for item in w.value.split(",")
        if item
    ]
