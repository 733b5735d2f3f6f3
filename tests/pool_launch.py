"""`loom COMMAND --nproc N` for the equivalence tests, in the session's kept rank processes (tests/distributed.py
`shared_pool`): what the launcher and its workers do to a run, without starting a launcher, torchrun and N
fresh interpreters (importing torch and loom in each takes longer than a three-step run on 2 cores). The
launcher itself (torchrun workers, restarts, signals, exit codes) is tested through the command in
test_run_control.py, test_faults.py, test_checkpoint.py and test_run_length.py."""

from __future__ import annotations

import os


def resolved_config(config: str, overrides: list[str]):
    """The run's config as `loom train` resolves it: train.init_from's architecture and tokenizer, or validated."""
    from loom.config import load_config

    cfg = load_config(config, overrides, validate=False)
    if cfg.train.init_from:
        from loom.interop.pretrained import resolve_init_from

        return resolve_init_from(cfg, overrides)
    cfg.validate()
    return cfg


def _rank(command: str, config: str, run_dir: str, overrides: list[str], world: int) -> None:
    """One worker of `loom COMMAND --nproc world` (loom/cli.py cmd_train in a worker), with the thread count
    loom.launch gives it."""
    import torch

    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # loom.launch's OMP_NUM_THREADS
    recipe = recipe_for(command)
    cfg = resolved_config(config, overrides)
    recipe.check(cfg)
    Trainer(cfg, run_dir, quiet=True, recipe=recipe).fit()


def launch_in_pool(command: str, config: str, run_dir, nproc: int, overrides: list[str]) -> None:
    """As loom.launch.launch before it starts the workers (the data-parallel size inferred from the process
    count, the layout checked for the recipe, the data prepared once here), then the workers' run on `nproc`
    kept ranks. A worker's error is raised here."""
    from distributed import shared_pool
    from loom.data.tokenizer import load_tokenizer
    from loom.post import recipe_for
    from loom.rules import check_layout, infer_dp_shard

    overrides = list(overrides)
    recipe = recipe_for(command)
    cfg = resolved_config(config, overrides)
    recipe.check(cfg)
    inferred = infer_dp_shard(cfg.parallel, nproc)
    if inferred:
        cfg.parallel.dp_shard = inferred[0]
        overrides.append(f"parallel.dp_shard={inferred[0]}")
    check_layout(cfg, nproc, recipe=recipe.command)
    recipe.prepare_data(cfg, load_tokenizer(cfg))
    shared_pool(nproc).run(_rank, command, config, str(run_dir), overrides, nproc)
