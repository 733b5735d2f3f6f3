"""Every `loom` command in the ```bash blocks of README.md, bench/README.md and docs/*.md works as written.

Commands that finish in seconds run exactly as written, in a scratch directory: `loom plan` (all but
`--profile-hardware`, which benchmarks this machine), `loom memory` and anything that only prints
(`--help`, `--version`). The others train for minutes (each `loom train` runs the tiny config's 450 steps,
or a 7B+ model) or read what an earlier command or the reader provides (`runs/t1`, `corpus.jsonl`,
`path/to/hf-llama`). Those are checked as far as loom goes before it starts work: the subcommand's
argument parser and, for `loom train`, the `--section.key=value` overrides, the config they make, the
layout rules for the command's process count and, with `recompute.mode=budget`, the recomputation plan.
"""

import os
import shlex
from unittest import mock

import pytest

from conftest import ROOT
from loom.cli import build_parser, main, split_overrides

# Files the README's commands expect the reader to have, and what stands in for them here.
READER_FILES = {"my.toml": ROOT / "configs" / "tiny.toml"}


# The manual, the measurements (bench/README.md) and the design notes (docs/): their commands are checked alike.
DOC_FILES = ["README.md", "bench/README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def readme_commands(name: str = "README.md") -> list[tuple[str, int, list[str]]]:
    """(file, line number, arguments after `loom`) of every `loom ...` command in the file's bash blocks."""
    commands, in_bash, text, start = [], False, "", 0
    for number, line in enumerate((ROOT / name).read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        start = start if text else number
        if line.endswith("\\"):  # continued on the next line
            text += line[:-1] + " "
            continue
        words = shlex.split(text + line, comments=True)
        text = ""
        if words[:1] == ["loom"]:
            commands.append((name, start, words[1:]))
    return commands


COMMANDS = readme_commands()  # the README alone: what a reader of the manual runs
ALL_COMMANDS = [c for name in DOC_FILES for c in readme_commands(name)]


def runs_in_seconds(argv: list[str]) -> bool:
    if not argv or argv[0].startswith("-") or {"-h", "--help", "--version"} & set(argv):
        return True
    return argv[0] == "memory" or (argv[0] == "plan" and "--profile-hardware" not in argv)


def ids(commands):
    return [f"{name}:{line}:{argv[0] if argv else ''}" for name, line, argv in commands]


CHEAP = [c for c in COMMANDS if runs_in_seconds(c[2])]


def measures_on_many_ranks(argv: list[str]) -> bool:
    """`loom memory --nproc N` (N > 2) measures in N processes (~15 s on 2 cores): make test-all, as
    test_memory's 4-rank measurement. In make test: the 2-rank measurement in real processes (test_memory)
    and the launcher's `loom memory --nproc 4` arguments (test_rules, torchrun faked)."""
    return argv[:1] == ["memory"] and "--nproc" in argv and int(argv[argv.index("--nproc") + 1]) > 2
CHECKED = [c for c in COMMANDS if not runs_in_seconds(c[2])]
ALL_CHEAP = [c for c in ALL_COMMANDS if runs_in_seconds(c[2])]
ALL_CHECKED = [c for c in ALL_COMMANDS if not runs_in_seconds(c[2])]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The command's working directory, with the reader's files; the environment is restored afterwards
    (the launcher sets OMP_NUM_THREADS)."""
    for name, source in READER_FILES.items():
        (tmp_path / name).write_text(source.read_text())
    monkeypatch.chdir(tmp_path)
    with mock.patch.dict(os.environ):
        yield tmp_path


def run_loom(argv: list[str]) -> int:
    """`loom ARGV` in this process; its exit code."""
    try:
        return main(argv)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return 0 if exc.code is None else exc.code


def test_readme_commands_are_found():
    assert {"train", "sft", "rm", "dpo", "rl", "plan", "memory", "generate", "convert", "preprocess"} <= {
        argv[0] for _, _, argv in COMMANDS}
    assert len(CHEAP) >= 8 and len(CHECKED) >= 20


@pytest.mark.parametrize("name, line, argv", [pytest.param(*c, marks=pytest.mark.slow) if measures_on_many_ranks(c[2])
                                              else c for c in ALL_CHEAP], ids=ids(ALL_CHEAP))
def test_cheap_readme_command_runs_as_written(name, line, argv, scratch, capsys):
    code = run_loom(argv)
    assert code == 0, f"{name} line {line}: loom {shlex.join(argv)} exited {code}\n{capsys.readouterr().err[-3000:]}"


@pytest.mark.parametrize("name, line, argv", ALL_CHECKED, ids=ids(ALL_CHECKED))
def test_readme_command_passes_loom_checks(name, line, argv, scratch):
    from loom.config import load_config
    from loom.memory import plan_budget
    from loom.post import recipe_for
    from loom.rules import check_layout

    args, extra = build_parser().parse_known_args(argv)  # a bad option or value exits 2 here
    if args.command not in ("train", "sft", "rm", "dpo", "rl"):
        assert not extra, f"{name} line {line}: unrecognised arguments {extra}"
        return
    cfg = load_config(args.config, split_overrides(extra))
    recipe = recipe_for(args.command)
    recipe.check(cfg)
    nproc = args.nproc
    if args.command == "rl":  # rl.mode=async: the generation ranks are not the layout's (as loom.cli splits them)
        from loom.post.rl.async_loop import training_processes

        nproc = training_processes(cfg, args.nproc, args.nnodes)
    if cfg.parallel.layout == "auto":  # the layout the planner would choose, on the GPU the docs' commands are for
        from loom.planner.auto import apply, choose
        from loom.planner.hardware import load_gpu

        gpu = load_gpu(cfg.parallel.auto_hardware or "h100")
        cfg = apply(cfg, choose(cfg, nproc * args.nnodes, recipe.command, gpu=gpu).values)
    check_layout(cfg, nproc * args.nnodes, recipe=recipe.command)
    if cfg.recompute.mode == "budget" and cfg.parallel.tp == 1:
        plan_budget(cfg)  # on the meta device, as the trainer plans a rank without tensor parallelism


@pytest.mark.parametrize("subcommand", sorted({argv[0] for _, _, argv in ALL_COMMANDS if argv and argv[0][0] != "-"}))
def test_every_subcommand_answers_help(subcommand, scratch, capsys):
    assert run_loom([subcommand, "--help"]) == 0
    assert "usage: loom " + subcommand in capsys.readouterr().out
