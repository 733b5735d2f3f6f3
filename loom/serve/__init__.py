"""`loom serve`: an OpenAI-compatible HTTP server on loom's engine (FastAPI + uvicorn, the `serve` extra).

    loom serve --model runs/t1 --port 8000
    curl localhost:8000/v1/completions -d '{"model": "t1", "prompt": "Once", "max_tokens": 16}'

The model loads as `loom generate --checkpoint` loads it (a run directory, a checkpoint, a loom model directory,
a Hugging Face directory; a LoRA run merged into its base), with its tokenizer, chat template and stop tokens.
One scheduler thread owns the engine (loom/serve/scheduler.py); the HTTP handlers (loom/serve/app.py) check
requests (loom/serve/protocol.py) and stream tokens back. Metrics: loom/serve/metrics.py.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from pathlib import Path

from loom.errors import UserError

DESCRIPTION = (
    "Serve a trained model over HTTP with OpenAI's API: POST /v1/completions, POST /v1/chat/completions (the "
    "model's chat template; stream: true as server-sent events), GET /v1/models, GET /health, GET /metrics "
    "(Prometheus). Requests arriving at different times are decoded together (continuous batching). Binds "
    "127.0.0.1 unless --host says otherwise; --api-key (or LOOM_API_KEY) requires 'Authorization: Bearer KEY' "
    "on every endpoint but /health. Needs the serve extra: pip install 'loom[serve]'. Example: loom serve "
    "--model runs/t1 --port 8000")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="what `loom generate --checkpoint` takes: a run directory (its "
                   "latest checkpoint), a checkpoint step-N directory, a loom model directory or a Hugging Face "
                   "model directory")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the port (default 8000)")
    p.add_argument("--nproc", type=int, default=1,
                   help="tensor-parallel processes on this machine (default 1): each holds a shard of the model and "
                        "its keys and values; rank 0 serves HTTP")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients give as \"model\" (default: the --model directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LOOM_API_KEY)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together at most (default 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests (choices) waiting for a slot at most; more get HTTP 429 (default 256)")
    p.add_argument("--max-tokens", type=int, default=4096, help="the largest max_tokens a request may ask for")
    p.add_argument("--max-n", type=int, default=16, help="the largest n a request may ask for (default 16)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="the longest prompt in tokens (default: the model's context minus one)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body (default 1 MiB)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival to its last token (default 600); then 504")
    p.add_argument("--sync-every", type=int, default=4,
                   help="decode steps between reads back to the host, as in loom generate (default 4: tokens "
                        "stream back every 4 steps)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="as in loom generate")
    p.add_argument("--kv", choices=["slab", "paged"], default="slab",
                   help="keys and values: a slab of max-batch x context positions (default), or paged blocks "
                        "from a pool, shared by requests with the same prompt (a request's n choices) and, through "
                        "the prefix cache, by requests whose prompts start alike")
    p.add_argument("--speculative", choices=["off", "ngram"], default="off",
                   help="speculative decoding, as in loom generate: ngram drafts by prompt lookup, verified in one "
                        "forward (greedy replies unchanged, sampling keeps its distribution; default off)")
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="with --speculative: tokens drafted per request and step at most (default 4)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="with --kv paged: do not keep whole blocks of keys and values for later requests whose "
                        "prompts start with the same tokens (the prefix cache is on by default)")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="as in loom generate: compiled decode steps (auto: on a GPU)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter of the model as NAME (repeatable): a PEFT adapter directory or a loom "
                        "LoRA run or checkpoint. A request whose \"model\" is NAME runs with it; requests of "
                        "different adapters and of the base are decoded together (one slab, eager steps)")


def load(model: str, name: str | None = None, device: str = "cpu", max_batch: int = 16, sync_every: int = 4,
         compile: str = "off", max_queue: int = 256, limits=None, api_key: str | None = None,
         timeout_s: float = 600.0, max_body: int = 1 << 20, mesh=None, paged: bool = False,
         prefix_cache: bool = True, loras: dict[str, str] | None = None, speculative: str = "off",
         draft_tokens: int = 4):
    """The model, its tokenizer and stops, an engine and its scheduler (not started) -> `app.Served`. `mesh`: a
    one-dimensional device mesh to shard the model over by tensor parallelism (`loom serve --nproc`). `loras`:
    adapter name -> path, chosen per request by its "model" (loom/infer/adapters.py)."""
    from loom import load_model
    from loom.data.tokenizer import Tokenizer
    from loom.generate import find_tokenizer
    from loom.infer.engine import Engine
    from loom.post.chat import find_template, stop_texts, stop_token_ids
    from loom.serve.app import Served
    from loom.serve.metrics import Metrics
    from loom.serve.protocol import Limits
    from loom.serve.scheduler import Scheduler

    net = load_model(model, device=device) if mesh is None else sharded_model(model, mesh, device)
    tok = Tokenizer.from_file(find_tokenizer(model))
    context = net.cfg.max_seq_len
    adapters = None
    if loras:
        from loom.infer.adapters import attach_adapters

        adapters = attach_adapters(net, loras)
        compile = "off" if compile == "auto" else compile
    engine = Engine(net, max_batch=max_batch, max_len=context, compile=compile, sync_every=sync_every,
                    decode=tok.decode, paged=paged, prefix_cache=prefix_cache, adapters=adapters,
                    speculative=speculative, draft_tokens=draft_tokens)
    scheduler = Scheduler(engine, Metrics(), max_queue=max_queue)
    return Served(name=name or Path(model).resolve().name, scheduler=scheduler, tokenizer=tok, context=context,
                  adapters=dict(loras or {}),
                  stop_ids=stop_token_ids(tok), stop_texts=stop_texts(tok), template=find_template(tok.path),
                  limits=limits or Limits(),
                  api_key=api_key, timeout_s=timeout_s, max_body=max_body)


def sharded_model(model: str, mesh, device):
    """This rank's tensor-parallel shard of the model at `model` (`loom serve --nproc`), built as RL builds its
    engine's copy: on meta, sharded over `mesh`, then only this rank's slices allocated and read
    (`loom.build.build_in_layout`, `loom.interop.pretrained.load_pretrained`; a LoRA run, or a PEFT adapter
    directory: its base's slices with this rank's slices of the adapters' products added,
    `loom.interop.peft.merge_peft_adapters`). No rank holds the whole model."""
    from loom.build import build_in_layout, whole
    from loom.config import Config
    from loom.interop.peft import is_peft_dir, merge_peft_adapters, peft_base
    from loom.parallel.tensor import apply_tensor_parallel
    from loom.rules import tp_problems

    if not Path(model).is_dir():
        raise UserError(f"--model {model!r} does not exist or is not a directory; give a loom run, checkpoint or model "
                        "directory or a Hugging Face model directory")

    def check(cfg) -> None:
        if problems := tp_problems(mesh.size(), cfg, cfg.max_seq_len, sp=False):
            raise UserError(f"--nproc={mesh.size()} cannot shard {model}: {'; '.join(problems)}")

    from loom.interop.pretrained import describe_source

    base = peft_base(model) if is_peft_dir(model) else Path(model)
    cfg = Config(model=describe_source(base).model)
    cfg.train.init_from = str(base.absolute())
    check(cfg.model)

    def place(net):
        apply_tensor_parallel(net, mesh, sp=False)
        return whole(net)

    net = build_in_layout(cfg, device, place, init_from=cfg.train.init_from).model
    if is_peft_dir(model):
        merge_peft_adapters(net, model)
    return net.eval()


def lora_arguments(args) -> dict[str, str]:
    """--lora NAME=PATH values checked: name -> path."""
    import re

    loras: dict[str, str] = {}
    base = args.served_model_name or Path(args.model).resolve().name
    for value in args.lora:
        name, sep, path = value.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name) or not path:
            raise UserError(f"--lora {value!r} must be NAME=PATH, NAME 1-64 letters, digits, '_', '.', ':' or '-'")
        if name in loras or name == base:
            raise UserError(f"--lora {value!r}: the name {name!r} is already taken (by "
                            f"{'the base model' if name == base else 'another --lora'}); give each adapter its own")
        if not Path(path).is_dir():
            raise UserError(f"--lora {value!r}: {path} is not a directory; give a PEFT adapter directory or a loom "
                            "LoRA run or checkpoint")
        loras[name] = path
    if loras and (args.nproc > 1 or args.kv == "paged" or args.compile == "on"):
        raise UserError("--lora serves adapters per request on one process, with --kv slab and eager steps; leave "
                        "out --nproc, --kv paged and --compile on")
    return loras


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args, extra) -> int:
    """`loom serve`: check the arguments, load, then run uvicorn until interrupted."""
    import importlib.util

    if extra:
        raise UserError(f"unrecognised arguments {' '.join(extra)}; see `loom serve --help`")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"loom serve needs {' and '.join(missing)}, which are not installed: pip install "
                        "'loom[serve]'")
    if args.nproc < 1:
        raise UserError(f"--nproc={args.nproc} must be >= 1")
    bounds = {"--port": (args.port, 0, 65535), "--max-batch": (args.max_batch, 1, None),
              "--max-queue": (args.max_queue, 1, None), "--max-tokens": (args.max_tokens, 1, None),
              "--max-n": (args.max_n, 1, None), "--max-body-bytes": (args.max_body_bytes, 1, None),
              "--sync-every": (args.sync_every, 1, None), "--draft-tokens": (args.draft_tokens, 1, None)}
    for flag, (value, low, high) in bounds.items():
        if value < low or (high is not None and value > high):
            raise UserError(f"{flag}={value} must be >= {low}" + (f" and <= {high}" if high is not None else ""))
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise UserError(f"--max-prompt-tokens={args.max_prompt_tokens} must be >= 1")
    if not args.request_timeout > 0:
        raise UserError(f"--request-timeout={args.request_timeout} must be > 0 seconds")
    loras = lora_arguments(args)
    key = args.api_key or os.environ.get("LOOM_API_KEY") or None
    if not _loopback(args.host) and key is None:
        print(f"loom serve: warning: binding {args.host} without an API key: anyone who can reach this address can "
              "use the model; give --api-key or set LOOM_API_KEY", file=sys.stderr)

    import socket

    from loom.launch import in_worker
    from loom.parallel.distributed import pick_device
    from loom.serve.protocol import Limits

    worker = in_worker() and int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by the --nproc launcher below
    rank = int(os.environ.get("RANK", "0")) if worker else 0
    device = pick_device(args.device, "--device")
    if rank == 0:
        try:  # before the model loads: a port in use or an address not here is bad input
            with socket.create_server((args.host, args.port)):
                pass
        except OSError as e:
            raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; give another --port or "
                            "--host") from None
    if args.nproc > 1 and not worker:  # the launcher: one worker per shard, the key passed in the environment
        from loom.launch import start_workers

        if key is not None:
            os.environ["LOOM_API_KEY"] = key
        return start_workers(["serve", *_worker_argv(args)], [], args.nproc)

    limits = Limits(max_tokens=args.max_tokens, max_n=args.max_n,
                    max_prompt_tokens=args.max_prompt_tokens or Limits.max_prompt_tokens)
    mesh = group = None
    if worker:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from loom.parallel.distributed import init_distributed
        from loom.serve.ranks import control_group

        init_distributed(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        group = control_group()
    served = load(args.model, args.served_model_name, device=device, max_batch=args.max_batch,
                  sync_every=args.sync_every, compile=args.compile, max_queue=args.max_queue, limits=limits,
                  api_key=key, timeout_s=args.request_timeout, max_body=args.max_body_bytes, mesh=mesh,
                  paged=args.kv == "paged", prefix_cache=args.prefix_cache, loras=loras,
                  speculative=args.speculative, draft_tokens=args.draft_tokens)
    if worker:
        from loom.serve.ranks import Leader, follow

        if rank != 0:  # this shard steps when rank 0 says so
            follow(served.scheduler.engine, group)
            return 0
        served.scheduler.engine = leader = Leader(served.scheduler.engine, group)
    try:
        return _run_http(args, served)
    finally:
        if worker:
            leader.close()


def _worker_argv(args) -> list[str]:
    """`loom serve`'s arguments again, for each tensor-parallel worker: the API key goes by the environment, and
    no --nproc (torchrun would take it for its own; a worker knows itself by torchrun's WORLD_SIZE)."""
    argv = ["--model", args.model, "--host", args.host, "--port", str(args.port), "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), "--max-tokens",
            str(args.max_tokens), "--max-n", str(args.max_n), "--max-body-bytes", str(args.max_body_bytes),
            "--request-timeout", str(args.request_timeout), "--sync-every", str(args.sync_every), "--device",
            args.device, "--compile", args.compile, "--kv", args.kv]
    if args.served_model_name is not None:
        argv += ["--served-model-name", args.served_model_name]
    if args.max_prompt_tokens is not None:
        argv += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    return argv


def _run_http(args, served) -> int:
    """uvicorn on a thread of its own, the engine's loop on this one until interrupted."""
    import threading

    import uvicorn

    from loom.serve.app import create_app

    alive_extra = getattr(served.scheduler.engine, "heartbeat", lambda: True)
    server = uvicorn.Server(uvicorn.Config(create_app(served), host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="loom-serve-http", daemon=True)
    http.start()
    print(f"loom serve: {served.name} ({args.model}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:  # the engine's loop on this thread, which built the engine (and recorded its CUDA graphs)
        served.scheduler.run(alive=lambda: alive_extra() and http.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
    return 0
