"""The `loom` command: train (sft, rm, dpo), plan, memory, generate, serve, convert, preprocess.

Exit codes: 0 success; 2 bad input (a one-paragraph message, no traceback); 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loom.errors import CollectiveTimeout, TrainingDiverged, UserError


def split_overrides(extra: list[str]) -> list[str]:
    """`--section.key=value` or `--section.key value` -> ["section.key=value", ...]."""
    from loom.config.load import other_name

    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        name = arg.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if arg.startswith("--") and (how := other_name(name)):
            raise UserError(f"unrecognised argument {arg!r}: {name} is what Hugging Face / TRL call it; in loom write "
                            f"{how}. loom's settings are --section.key=value (see `loom train --help`)")
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(
                f"unrecognised argument {arg!r}; config overrides look like --section.key=value "
                "(e.g. --train.steps=100); see `loom train --help`"
            )
        if "=" in arg:
            out.append(arg[2:])
            i += 1
        elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            out.append(f"{arg[2:]}={extra[i + 1]}")
            i += 2
        else:
            raise UserError(f"override {arg!r} has no value; write {arg}=VALUE")
    return out


def cmd_train(args, extra) -> int:
    from loom.config import load_config
    from loom.launch import in_worker, launch
    from loom.post import recipe_for

    global _user_code
    recipe = recipe_for(args.command)  # the one place the recipe is chosen: by the subcommand
    overrides = split_overrides(extra)
    cfg = load_config(args.config, overrides, validate=False)
    if cfg.train.init_from:  # the architecture and tokenizer come from the pretrained weights (validates)
        from loom.interop.pretrained import resolve_init_from

        cfg = resolve_init_from(cfg, overrides)
    else:
        cfg.validate()
    recipe.check(cfg)
    _user_code = recipe.runs_user_code(cfg)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    if args.export_hf:
        _check_export(args.export_hf, cfg)
    if args.nproc < 1 or args.nnodes < 1:
        raise UserError(f"--nproc={args.nproc} and --nnodes={args.nnodes} must be >= 1")
    choice = None
    if cfg.parallel.layout == "auto":
        cfg, choice = _auto_layout(cfg, args, recipe.command)
    nproc = args.nproc
    if recipe.command == "rl" and not in_worker():  # rl.mode=async: training rank 0 starts the generation ranks
        from loom.post.rl.async_loop import training_processes

        nproc = training_processes(cfg, args.nproc, args.nnodes)
    if (nproc > 1 or args.nnodes > 1) and not in_worker():
        if args.nnodes > 1 and not args.run_dir:
            raise UserError("--nnodes > 1 needs an explicit --run-dir on storage every node shares")
        run_dir = args.run_dir or cfg.default_run_dir()

        def prepare_data() -> None:  # tokenize / index the data once, here, before the workers start
            from loom.data.tokenizer import load_tokenizer

            recipe.prepare_data(cfg, load_tokenizer(cfg))

        code = launch(cfg, [args.command, "--config", args.config, "--run-dir", str(run_dir)], overrides, nproc,
                      args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts, prepare_data=prepare_data,
                      recipe=recipe.command)
        if code == 0 and args.export_hf and args.node_rank == 0:  # the workers' final checkpoint, exported here
            latest = Path(run_dir) / "checkpoints" / "latest"  # before train.steps: a signal, train.exit_after_*
            if latest.is_file() and int(latest.read_text().strip()[5:]) < cfg.train.steps:
                print(f"not exported to {args.export_hf}: the run stopped before train.steps={cfg.train.steps}; resume "
                      "it, or export the checkpoint with loom convert", file=sys.stderr)
            else:
                _export_hf(run_dir, args.export_hf)
        return code
    from loom.train.trainer import Trainer

    trainer = Trainer(cfg, args.run_dir, recipe=recipe)
    if choice is not None:
        trainer.prediction = choice.prediction()
    result = trainer.fit()
    if trainer.is_main:
        print(f"run directory: {trainer.run_dir}")
        if result:
            print("final eval: " + "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "step"))
        if choice is not None:
            from loom.planner.auto import summary

            print(summary(trainer.prediction, trainer.step_times, trainer.memory_gib()))
        if args.export_hf and trainer.stopped_at is None and not in_worker():
            _export_hf(trainer.run_dir, args.export_hf)
    import torch.distributed as dist

    if dist.is_initialized():  # every rank finished the same steps: release the process groups cleanly
        dist.destroy_process_group()
    return 0


AUTO_LAYOUT_ENV = "LOOM_AUTO_LAYOUT"  # the launcher's choice, read by its workers (they do not search again)


def _auto_layout(cfg, args, recipe: str):
    """`parallel.layout=auto`: the planner's choice applied to `cfg` (loom/planner/auto.py); the launcher
    chooses and prints, its workers take the same choice from the environment it passes them."""
    from loom.launch import in_worker
    from loom.planner.auto import Choice, apply, choose

    if in_worker() and os.environ.get(AUTO_LAYOUT_ENV):
        choice = Choice.from_json(os.environ[AUTO_LAYOUT_ENV])
    else:
        if in_worker():  # started by torchrun directly
            world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        else:
            world, local = args.nproc * args.nnodes, args.nproc
        choice = choose(cfg, world, recipe, local_procs=local)
        print(choice.describe(), file=sys.stderr, flush=True)
        os.environ[AUTO_LAYOUT_ENV] = choice.to_json()  # inherited by the launcher's workers
    cfg = apply(cfg, choice.values)
    cfg.validate()
    return cfg, choice


def _check_export(dst: str, cfg) -> None:
    """`--export-hf DIR`, refused before training: DIR must be new (or empty) and the final step checkpointed."""
    from loom.interop.hf_io import _check_free

    _check_free(Path(dst))
    if not cfg.checkpoint.save_final:
        raise UserError(f"--export-hf {dst} exports the final checkpoint, but checkpoint.save_final=false; drop "
                        "--checkpoint.save_final=false or --export-hf")


def _export_hf(run_dir, dst: str) -> None:
    """The run's final checkpoint as a Hugging Face model directory with its tokenizer files (loom convert)."""
    from loom.interop import convert
    from loom.interop.peft import is_lora_checkpoint

    # A LoRA run's checkpoint holds its adapters: the export is the merged full model.
    print(f"exported a Hugging Face model to {convert(run_dir, dst, 'hf', merge=is_lora_checkpoint(run_dir))}")


def cmd_memory(args, extra) -> int:
    import json

    from loom.config import load_config
    from loom.launch import in_worker, launch
    from loom.memory import report

    overrides = split_overrides(extra)
    if args.attention:  # loom plan's names: flash is SDPA's fused kernel
        overrides.append(f"model.attention={'math' if args.attention == 'math' else 'sdpa'}")
    cfg = load_config(args.config, overrides)
    if args.nproc > 1 and not in_worker():
        command = ["memory", "--config", args.config] + (["--json"] if args.json else [])
        return launch(cfg, command, overrides, args.nproc)
    result = report(cfg)
    if result is None:  # not rank 0
        return 0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from loom.memory import format_table

        print(format_table(result))
    return 0


def cmd_plan(args, extra) -> int:
    from loom.planner.command import run

    if extra:
        raise UserError(f"unrecognised arguments {' '.join(extra)}; see `loom plan --help`")
    if args.profile_hardware:
        from loom.infer.probe import measure

        return run(args, engine_probe=measure)
    return run(args)


def cmd_generate(args, extra) -> int:
    from loom.generate import generate

    return generate(args, extra)


def cmd_serve(args, extra) -> int:
    from loom.serve import serve

    return serve(args, extra)


def cmd_convert(args, extra) -> int:
    from loom.interop import convert

    if extra:
        raise UserError(f"unrecognised arguments {' '.join(extra)}; see `loom convert --help`")
    out = convert(args.src, args.dst, args.to, merge=args.merge)
    print(f"wrote {out}")
    return 0


def cmd_preprocess(args, extra) -> int:
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import Tokenizer

    if extra:
        raise UserError(f"unrecognised arguments {' '.join(extra)}; see `loom preprocess --help`")
    if args.workers < 1:
        raise UserError(f"--workers={args.workers} must be >= 1")
    spec = args.tokenizer
    if Path(spec).exists():
        tok = Tokenizer.from_file(spec)
    else:
        from loom.config import load_config
        from loom.data.tokenizer import load_tokenizer

        tok = load_tokenizer(load_config(spec))
    if args.eod_token:
        tok.set_eod(args.eod_token)
    if args.sft:  # examples with their loss mask, for sft.data (loom/post/sft_data.py)
        from loom.data.preprocess import input_files
        from loom.post.chat import load_template
        from loom.post.sft_data import write_prefix

        existing = [p for p in (Path(f"{args.output_prefix}{s}") for s in (".bin", ".idx", ".sft.json")) if p.exists()]
        if existing and not args.overwrite:
            raise UserError(f"{', '.join(map(str, existing))} already exist; pass --overwrite to replace them, or choose "
                            "another --output-prefix (nothing was changed)")
        Path(f"{args.output_prefix}.sft.json").unlink(missing_ok=True)  # incomplete until written again, last
        template = load_template(args.template, tok.path, "--template")
        columns = {"messages": args.messages_column, "prompt": args.prompt_column,
                   "completion": args.completion_column}
        meta = write_prefix(input_files(args.input), args.output_prefix, tok, template, columns)
        print(f"wrote {args.output_prefix}.bin/.idx and its loss mask: {meta['examples']} examples, {meta['tokens']} "
              f"tokens, {meta['learned_tokens']} learned (template {template.name})")
        return 0
    stats = preprocess(args.input, str(args.output_prefix), tok, json_key=args.json_key, workers=args.workers,
                       append_eod=args.append_eod, progress=sys.stderr.isatty(), overwrite=args.overwrite)
    print(f"wrote {args.output_prefix}.bin/.idx: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from loom import __version__

    parser = argparse.ArgumentParser(prog="loom", description="Train large language models on one CPU or many GPUs.")
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model", description="Train a model. Any config key can be "
                       "overridden as --section.key=value, e.g. --train.steps=200 --model.layers=4.")
    p.add_argument("--config", required=True, help="a name in configs/ (tiny, llama3-8b, ...) or a .toml path")
    p.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default runs/NAME-TIME)")
    p.add_argument("--nproc", type=int, default=1, help="worker processes on this machine (gloo on CPU, nccl on GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="machines taking part (c10d rendezvous)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (node 0), for --nnodes > 1")
    p.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    p.add_argument("--print-config", action="store_true",
                   help="print the merged config (defaults, file, overrides) as TOML and exit")
    p.add_argument("--export-hf", default=None, metavar="DIR",
                   help="when training ends, write the final checkpoint as a Hugging Face model directory DIR (as "
                   "loom convert RUN DIR --to hf: config.json, safetensors, the tokenizer with its chat template, "
                   "eos_token and generation_config.json)")
    p.set_defaults(func=cmd_train)
    train_parser = p

    # Post-training recipes: `loom train` with a recipe's data set, so the same options and overrides.
    recipes = {
        "sft": ("supervised fine-tuning on chat or prompt/completion examples",
                "Fine-tune on .jsonl examples (sft.data): chat records {\"messages\": [{\"role\", \"content\"}, ...]} "
                "rendered with the model's chat template (sft.template), or {\"prompt\", \"completion\"}; the loss "
                "counts only assistant / completion tokens; sft.packing puts several examples in a sequence with "
                "attention kept inside each. Usually from --train.init_from=MODEL. Example: loom sft --config tiny-sft"),
        "rm": ("train a reward model on chosen/rejected pairs",
               "Train a reward model: a scalar head on the model's last hidden state, loss -log sigmoid(r_chosen - "
               "r_rejected), on .jsonl pairs (pref.data) of {\"prompt\", \"chosen\", \"rejected\"} (strings, or chat "
               "messages rendered with pref.template); reports pair accuracy (val_accuracy held out). Usually from "
               "--train.init_from=MODEL. Example: loom rm --config tiny-rm"),
        "rl": ("online RL (GRPO family, PPO) with loom's generation engine in the loop",
               "Train a policy on its own completions of .jsonl prompts (rl.prompts), generated by loom's engine "
               "(refitted after every update) and scored by rl.reward (package.module:function) and/or "
               "rl.reward_model (a loom rm run). rl.algorithm=grpo (group baselines: GRPO, Dr. GRPO, DAPO, GSPO, "
               "RLOO settings) or ppo (value head, GAE); every step logs its time split and the trainer/engine "
               "log-prob mismatch. Usually from --train.init_from=MODEL. Example: loom rl --config tiny-grpo"),
        "dpo": ("direct preference optimisation (DPO, IPO) on chosen/rejected pairs",
                "Fine-tune a policy with DPO (pref.loss=dpo) or IPO (pref.loss=ipo), beta pref.beta, on .jsonl pairs "
                "(pref.data); the reference log-probs are the initial policy's, computed once before the first "
                "step. Logs chosen/rejected rewards, margin and pair accuracy. Usually from "
                "--train.init_from=MODEL. Example: loom dpo --config tiny-dpo"),
    }
    for name, (help_, description) in recipes.items():
        p = sub.add_parser(name, help=help_, parents=[train_parser], add_help=False, conflict_handler="resolve",
                           description=description + ". The same options and overrides as train.")
        p.set_defaults(func=cmd_train)

    from loom.planner.command import add_arguments as add_plan_arguments

    p = sub.add_parser("plan", help="choose a parallel layout and predict memory and speed",
                       description="Search every valid layout (tp, pp, vpp, dp, cp, micro-batch, sp, recompute, "
                       "dp style) for a model on a cluster, predict per-GPU memory and step time term by term, "
                       "and rank what fits. Example: loom plan --model gpt3-175b --gpus 1024 --gpu a100-80gb")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("memory", help="measure activation memory and FLOPs of a config and layout",
                       description="Measure the bytes one layer saves for backward (per rank), the FLOPs of a "
                       "step and the parameter/gradient/optimizer bytes. Overrides as for train.")
    p.add_argument("--config", required=True)
    p.add_argument("--nproc", type=int, default=1, help="processes (needed when parallel.tp > 1)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.add_argument("--attention", choices=["flash", "sdpa", "math"], default=None,
                   help="as in loom plan: a fused kernel (flash, i.e. model.attention=sdpa) or the materialised "
                   "softmax (math); default: the config's model.attention")
    p.set_defaults(func=cmd_memory)

    from loom.generate import DESCRIPTION as GENERATE, add_arguments as add_generate_arguments

    p = sub.add_parser("generate", help="continue a prompt with a trained model", description=GENERATE)
    add_generate_arguments(p)
    p.set_defaults(func=cmd_generate)

    from loom.serve import DESCRIPTION as SERVE, add_arguments as add_serve_arguments

    p = sub.add_parser("serve", help="serve a trained model with OpenAI's HTTP API", description=SERVE)
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="convert between Hugging Face (Llama, Qwen2.5, Qwen3, Mixtral, Qwen2/3-MoE) "
                       "and loom checkpoints",
                       description="Convert a model between Hugging Face (config.json + safetensors) and loom "
                       "(model.safetensors + config.toml + tokenizer.json). Example: loom convert runs/t1 "
                       "exported/t1-hf --to hf")
    p.add_argument("src", help="a Hugging Face model directory, or a loom run / checkpoint / model directory")
    p.add_argument("dst", help="the directory to write (new, or an empty directory)")
    p.add_argument("--to", required=True, choices=["loom", "hf", "peft"],
                   help="the format to write; peft: a LoRA run's adapters (adapter_config.json, "
                   "adapter_model.safetensors) for peft on the base model")
    p.add_argument("--merge", action="store_true", help="with --to hf: a LoRA run's adapters folded into its base "
                   "weights, written as a full Hugging Face model")
    p.set_defaults(func=cmd_convert)

    from loom.data.preprocess import add_arguments

    p = sub.add_parser("preprocess", help="tokenize text into a Megatron-style .bin/.idx dataset",
                       description="Tokenize .jsonl/.json/.txt files (or a directory of them) into PREFIX.bin/.idx "
                       "(Megatron's indexed format) plus PREFIX.stats.json (document and token counts, the largest "
                       "token id). Refuses to replace an existing dataset without --overwrite. Example: loom "
                       "preprocess --input docs.jsonl --output-prefix data/docs --tokenizer tiny --append-eod")
    add_arguments(p)
    p.set_defaults(func=cmd_preprocess)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    from loom import compile_cache

    compile_cache.activate(f"loom-{args.command}")  # only where LOOM_COMPILE_CACHE_LOAD / _SAVE are set
    try:
        return args.func(args, extra)
    except UserError as exc:
        print(f"loom {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        print(f"loom {args.command}: training diverged: {exc}", file=sys.stderr)
        return 3
    except CollectiveTimeout as exc:
        print(f"loom {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _flush() -> bool:
    """Flush Python's standard streams, then C's stdio buffers (libraries' own output, e.g. NCCL_DEBUG
    lines, which `os._exit` would drop). False when a stream could not be flushed (a closed pipe)."""
    ok = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # closed when the process started
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            ok = False
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    return ok


_user_code = False  # set by cmd_train when the run imports the user's own modules (an RL reward function)


def _exit(code: int | None) -> None:
    """Leave with `code`, skipping the interpreter's teardown where that is safe.

    - A worker started by the launcher that fails leaves at once: its process group's C++ threads
      (gloo/nccl) may still be running, and destroying them during Python's finalisation can abort the
      process (SIGABRT, "terminate called without an active exception"), which would turn a clean exit 2
      (bad input) into a crash the launcher cannot classify.
    - Otherwise the exit handlers run (logging's flush, multiprocessing's children, inductor's compile
      process pool, temporary directories), and the process leaves without deallocating every object of
      torch's modules one by one, which costs CPU time in every process (every worker and the launcher
      pay it).
    - The ordinary exit is kept while another non-daemon thread runs (it waits for it; inductor's idle
      compile threads count), when a stream cannot be flushed (Python then reports it and exits 120, as
      always), under a tracer or profiler (`python -m cProfile`, coverage, pdb: they write their results
      after the program returns), after the user's own code was imported (a reward function: its open
      files may be flushed only by their finalisers), and when the environment sets LOOM_ORDINARY_EXIT=1."""
    import atexit
    import threading

    from loom.launch import in_worker

    code = 0 if code is None else int(code)
    flushed = _flush()
    if code and in_worker():
        os._exit(code)
    running = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    traced = sys.gettrace() is not None or sys.getprofile() is not None
    if (running or run_handlers is None or not flushed or traced or _user_code
            or os.environ.get("LOOM_ORDINARY_EXIT") == "1"):
        sys.exit(code)
    run_handlers()
    _flush()
    os._exit(code)


def run() -> None:
    """The `loom` command (console script): `main`, then `_exit`."""
    _exit(main())


if __name__ == "__main__":
    run()
