"""Load on `loom serve`: N concurrent streaming clients with ragged prompts; throughput, time to first token and
inter-token latency percentiles.

    python bench/serve_load.py --smoke --out /tmp/serve_smoke.json                  # tiny, CPU (a test runs it)
    python bench/serve_load.py --shape small --clients 64 --out bench/results/serve_load_h100.json    # on a GPU
    python bench/serve_load.py --model runs/t1 --clients 32 --out F.json            # a model of yours
    python bench/serve_load.py --url http://127.0.0.1:8000 --model-name t1 --out F.json   # a running server

Without --url it starts `loom serve` in its own process (so clients and server do not share an interpreter) on
--model, or on a model with random weights of --shape (built here with loom, saved with a word-level tokenizer;
nothing is downloaded), and stops it at the end. Each of --clients clients sends --rounds streaming
/v1/completions requests one after another; a request's prompt is random token ids, its length drawn uniformly
from [--min-prompt, --max-prompt] (seeded), greedy, --max-tokens new tokens. Measured at the client:

- throughput: generated tokens (the chunks' `token_ids`; one per chunk from a server without them) over the
  wall time from the first request sent to the last finished, and requests per second;
- time to first token: from sending a request to its first chunk with a token; p50, p90, p99 over requests;
- inter-token latency: between consecutive token-bearing chunks of a request, divided by the tokens of the
  later one (a decode window's tokens arrive together); p50, p90, p99 over tokens;
- the server's /metrics before and after (decode steps, the rows they decoded, the largest batch), when it
  has them.

The JSON (machine, torch, commit, command, settings, results) is written at the end.
`--smoke`: the tiny shape on the CPU, 6 clients x 2 rounds of 8 tokens; it checks that the script runs end
to end (tests/test_bench_serve_load.py), not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {  # loom ModelConfig fields
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=256),
    "small": dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn_hidden=1536, vocab_size=32000, max_seq_len=2048),
    "llama3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        max_seq_len=2048, tie_embeddings=True),
}


def random_model(path: Path, shape: str) -> Path:
    """A loom model directory with random weights of `shape` and a word-level tokenizer ("w0".."wN")."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loom.config import Config, ModelConfig
    from loom.models.io import save_model_dir
    from loom.models.llama import build_model

    cfg = Config(model=ModelConfig(**SHAPES[shape]))
    cfg.train.seq_len = cfg.model.max_seq_len
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.model.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    with torch.no_grad():
        model = build_model(cfg.model, seed=0)
    save_model_dir(model, cfg, path, tokenizer_path=path / "tokenizer.json")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loom.cli", "serve", "--model", str(model), "--port", str(port), "--max-batch",
           str(args.max_batch), "--device", args.device, "--max-queue", str(max(256, args.clients * 2)),
           "--served-model-name", args.model_name]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"loom serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


def server_metrics(url: str, headers: dict) -> dict[str, float]:
    import httpx

    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    s = sorted(values)

    def at(q: float) -> float:  # nearest rank
        return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "count": len(s)}


async def one_request(client, url: str, body: dict) -> dict:
    start = time.perf_counter()
    arrivals = []  # (time, tokens) of each chunk with tokens
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": (await r.aread()).decode()[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"ok": False, "status": 200, "error": json.dumps(chunk)[:300]}
            k = 0
            for c in chunk.get("choices", []):
                ids = c.get("token_ids")
                k += len(ids) if ids is not None else (1 if c.get("text") else 0)
            if k:
                arrivals.append((time.perf_counter(), k))
    end = time.perf_counter()
    itl = []
    for (t0, _), (t1, k) in zip(arrivals, arrivals[1:]):
        itl += [(t1 - t0) / k] * k
    return {"ok": True, "start": start, "end": end, "tokens": sum(k for _, k in arrivals),
            "ttft": arrivals[0][0] - start if arrivals else None, "itl": itl}


async def load(url: str, args, headers: dict) -> tuple[list[dict], float]:
    import httpx

    rng = random.Random(args.seed)
    plans = [[[rng.randrange(args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
              for _ in range(args.rounds)] for _ in range(args.clients)]
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers) as client:
        async def worker(prompts):
            out = []
            for ids in prompts:
                body = {"model": args.model_name, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                        "stream": True}
                out.append(await one_request(client, url, body))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(worker(p) for p in plans))
        wall = time.perf_counter() - start
    return [r for rs in results for r in rs], wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start loom serve here)")
    ap.add_argument("--model", default=None, help="what loom serve --model takes (default: random --shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the random model's shape")
    ap.add_argument("--model-name", default="bench", help="the served model name")
    ap.add_argument("--api-key", default=os.environ.get("LOOM_API_KEY"))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="requests each client sends, one after another")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn below this (default: the model's)")
    ap.add_argument("--max-batch", type=int, default=64, help="loom serve --max-batch (when started here)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take at the client")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds the server may take to start")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script runs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.device, args.clients, args.rounds = "tiny", "cpu", 6, 2
        args.min_prompt, args.max_prompt, args.max_tokens, args.max_batch = 4, 40, 8, 8
    from loom.provenance import stamp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, tmp = None, None
    url = args.url.rstrip("/") if args.url else None
    try:
        if url is None:
            model = args.model
            if model is None:
                tmp = tempfile.TemporaryDirectory(prefix="serve_load_")
                model = str(random_model(Path(tmp.name) / args.shape, args.shape))
            if args.vocab is None:
                args.vocab = _vocab(model)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(Path(model), port, args)
        elif args.vocab is None:
            args.vocab = 1000
        wait_healthy(url, proc, args.start_timeout)
        before = server_metrics(url, headers)
        results, wall = asyncio.run(load(url, args, headers))
        after = server_metrics(url, headers)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tmp is not None:
            tmp.cleanup()
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    report = {
        **stamp("python bench/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:])),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "api_key")} | {"url": args.url},
        "requests": len(results), "ok": len(ok), "failed": [r for r in results if not r["ok"]][:5],
        "generated_tokens": tokens, "wall_s": round(wall, 4),
        "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "ttft_s": percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl"]]),
    }
    if after:
        steps = after.get("loom_decode_steps_total", 0) - before.get("loom_decode_steps_total", 0)
        rows = after.get("loom_decode_rows_total", 0) - before.get("loom_decode_rows_total", 0)
        report["server"] = {"decode_steps": steps, "decode_rows": rows,
                            "mean_batch": round(rows / steps, 2) if steps else None,
                            "max_batch": after.get("loom_decode_batch_max")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(ok)}/{len(results)} requests, {tokens} tokens in {wall:.2f} s: {report['tokens_per_s']} tokens/s, "
          f"TTFT p50 {report['ttft_s']['p50']}, ITL p50 {report['itl_s']['p50']}; wrote {args.out}")
    return 0 if len(ok) == len(results) else 1


def _vocab(model: str) -> int:
    """The size of the model's tokenizer's vocabulary (prompt ids are drawn below it)."""
    from loom.data.tokenizer import Tokenizer
    from loom.generate import find_tokenizer

    return Tokenizer.from_file(find_tokenizer(model)).vocab_size


if __name__ == "__main__":
    sys.exit(main())
