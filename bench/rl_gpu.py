"""One GPU, one command: `loom rl` (GRPO, the engine in the loop) on a 0.5-1B model, each step's time split
into its phases (issue 37, item 5).

    python bench/rl_gpu.py --out bench/results/rl_gpu_h100.json                  # on a GPU machine
    python bench/rl_gpu.py --shape qwen2.5-0.5b --out ...                         # the other shape
    python bench/rl_gpu.py --smoke --out /tmp/smoke.json                          # tiny, CPU (a test runs it)
    python bench/rl_gpu.py --mode async --out ...   # rl.mode=async: 1 training + 1 generation process (issue 56)

`--mode async` runs the same steps as `loom rl --nproc 2` with `rl.mode=async`, `rl.generation_ranks=1` and
`rl.max_staleness=--staleness` (default 1): the trainer and the generation rank share the one GPU, so what it
measures is how much of generation hides behind training there; `generation_s` is then the trainer's wait for
its rollouts, and each row also carries `staleness_mean` and `rollout_wait_s`.

What runs is `loom rl` itself, as a user would start it (`python -m loom.cli rl --config tiny-grpo`, its GRPO
objective as that config spells it, every other setting on the command line and in the JSON's `settings`),
in a temporary run directory:

- **Model**: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 key/value heads, MLP 8192, vocabulary
  128256, tied) or Qwen2.5-0.5B's (`--shape qwen2.5-0.5b`: 24 layers, hidden 896, 14 heads, 2 key/value
  heads, MLP 4864, vocabulary 151936, tied, biases on q/k/v), random weights (no train.init_from: the policy
  is initialised from train.seed). Training in bf16 autocast over fp32 master weights (train.dtype=bfloat16),
  the engine's copy in bf16; its decode steps compiled (rl.engine_compile=auto: CUDA graphs on a GPU).
- **Task**: made here, nothing downloaded. A word-level tokenizer with one word per id of the model's
  vocabulary ("w1", "w2", ...; id 0 is <|endoftext|>, where a completion stops), so every prompt is exactly
  `--prompt` tokens (random words) and every sampled id decodes; the reward is the share of a completion's
  words with an even id (a random policy scores about one half with a spread within each group, so the
  advantages are not all zero and training does real work).
- **GRPO**: `--prompts` prompts per step, `--group` completions each (train.global_batch = their product, all
  decoded together: rl.engine_batch the same), responses up to `--new` tokens at temperature 1, one
  optimizer step per step, a KL term to a frozen reference (rl.kl_coef > 0) so that the log-prob phase
  computes both the old and the reference log-probs, as GRPO with a KL penalty does.

Per step, from the run's metrics.jsonl (loom times each phase of its RL step, loom/post/rl/recipe.py): the
step's wall time (`step_s`, the device synchronised) and its phases, generation (`generation_s`), rewards
(`reward_s`), old and reference log-probs (`logprobs_s`), training (`training_s`), the engine's refit
(`refit_s`), what is left (`other_s`); generated tokens, generation tokens/s and the share of the step spent
generating. The first `--warmup` steps are rows too, marked `warmup` and left out of the `summary` (medians
of the phases; shares and tokens/s from sums over the measured steps). `startup_s`: from the start of `loom
rl` to the start of its first step (imports, the models' build, the engine's graphs, the evaluation before
step 1; when the first row appeared less that step's time, to within the half-second poll).

The JSON is rewritten after every step row, so a run cut short keeps what it measured: a failed run, one
past `--timeout`, or this script terminated (SIGTERM, as the device check's step timeout sends) ends with an
error row after the finished ones. Once the last step's row is in, loom rl is ended (its final evaluation
is not measured). loom rl's own output goes to OUT_loom_rl.log beside the JSON.

`--smoke`: a 2-layer model in fp32 on the CPU, 2 prompts of 12 tokens x 4 completions of up to 8 tokens,
3 steps; it checks that the script runs end to end (tests/test_bench_rl_gpu.py), not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {  # loom model.* settings
    "llama3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn_hidden=8192, vocab_size=128256,
                        tie_embeddings="true", rope_theta=500000.0),
    "qwen2.5-0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, ffn_hidden=4864, vocab_size=151936,
                         tie_embeddings="true", qkv_bias="true", rope_theta=1000000.0),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, tie_embeddings="true"),
}
PHASES = ("generation_s", "reward_s", "logprobs_s", "training_s", "refit_s")
EOD = "<|endoftext|>"
REWARD_MODULE = '''"""bench/rl_gpu.py's reward: the share of the completion's words ("w<id>") whose id is even."""


def even_share(prompt, completion, **_):
    words = completion.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)
'''


class CutOff(Exception):
    """This script was terminated (SIGTERM) while `loom rl` ran."""


def write_task(tmp: Path, vocab: int, prompt: int, count: int, seed: int) -> None:
    """tokenizer.json (a word per id), prompts.jsonl (`count` prompts of `prompt` words), valid.jsonl (one),
    the reward module."""
    import random

    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = {EOD: 0, **{f"w{i}": i for i in range(1, vocab)}}
    tok = tokenizers.Tokenizer(models.WordLevel(words, unk_token=EOD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOD])
    tok.save(str(tmp / "tokenizer.json"))
    rng = random.Random(seed)
    for name, n in (("prompts.jsonl", count), ("valid.jsonl", 1)):
        lines = [json.dumps({"prompt": " ".join(f"w{rng.randrange(1, vocab)}" for _ in range(prompt))})
                 for _ in range(n)]
        (tmp / name).write_text("\n".join(lines) + "\n")
    (tmp / "rl_gpu_reward.py").write_text(REWARD_MODULE)


def settings(args, shape: str, tmp: Path, cuda: bool) -> list[str]:
    """`loom rl`'s command-line settings (without the leading --)."""
    seq = args.prompt + args.new  # train.seq_len; the engine holds seq_len + 1 tokens (loom/post/rl/prompts.py)
    batch = args.prompts * args.group
    return [f"model.{k}={v}" for k, v in SHAPES[shape].items()] + [
        f"model.max_seq_len={seq + 1}", f"data.tokenizer={tmp / 'tokenizer.json'}",
        f"train.seq_len={seq}", f"train.global_batch={batch}", f"train.micro_batch={min(args.micro_batch, batch)}",
        f"train.steps={args.warmup + args.steps}", f"train.dtype={'bfloat16' if cuda else 'float32'}",
        f"train.device={'cuda' if cuda else 'cpu'}", "train.eval_interval=0", "train.log_interval=1", "optim.lr=1e-6", "optim.min_lr=1e-6",
        "optim.warmup_steps=0",
        f"rl.prompts={tmp / 'prompts.jsonl'}", f"rl.valid_prompts={tmp / 'valid.jsonl'}",
        "rl.reward=rl_gpu_reward:even_share", "rl.algorithm=grpo", f"rl.group_size={args.group}",
        f"rl.max_new_tokens={args.new}", f"rl.engine_batch={batch}", "rl.temperature=1.0", "rl.kl_coef=0.001",
        "rl.epochs=1", "rl.minibatches=1", "checkpoint.save_final=false", "log.progress=none",
        "log.tensorboard=false",
    ]


def step_row(metrics: dict, warmup: int) -> dict:
    """A bench row from one step row of metrics.jsonl."""
    step_s = metrics["step_time_s"]
    row = {"step": metrics["step"], "warmup": metrics["step"] <= warmup, "step_s": round(step_s, 4)}
    for k in PHASES:
        row[k] = round(metrics[k], 4)
    row["other_s"] = round(step_s - sum(metrics[k] for k in PHASES), 4)
    tokens = metrics["generated_tokens"]
    row["generated_tokens"] = tokens
    row["response_tokens_mean"] = round(metrics["response_length"], 1)
    # rl.mode=async: generation_s is the trainer's wait for rollouts made beside it, not their making
    made_here = "rollout_wait_s" not in metrics
    row["generation_tokens_per_s"] = round(tokens / metrics["generation_s"], 1) if metrics["generation_s"] and made_here \
        else None
    row["generation_share"] = round(metrics["generation_s"] / step_s, 4)
    for k in ("reward", "logp_abs_diff", "loss", "memory_gib", "staleness_mean", "rollout_wait_s"):
        if k in metrics:
            row[k] = round(metrics[k], 6)
    return row


def summary(rows: list[dict]) -> dict | None:
    """Medians of the measured (not warm-up) steps' phases; share and tokens/s from their sums."""
    done = [r for r in rows if "error" not in r and not r["warmup"]]
    if not done:
        return None
    out = {"steps": len(done)}
    for k in ("step_s", *PHASES, "other_s"):
        out[k + "_median"] = round(statistics.median(r[k] for r in done), 4)
    step, gen = sum(r["step_s"] for r in done), sum(r["generation_s"] for r in done)
    out["generation_share"] = round(gen / step, 4)
    made_here = all(r.get("generation_tokens_per_s") is not None for r in done)
    out["generation_tokens_per_s"] = round(sum(r["generated_tokens"] for r in done) / gen, 1) if gen and made_here \
        else None
    for k in PHASES[1:]:
        out[k.replace("_s", "_share")] = round(sum(r[k] for r in done) / step, 4)
    return out


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def run_and_collect(cmd: list[str], env: dict, metrics: Path, log: Path, out: Path, result: dict, warmup: int,
                    timeout: float | None, started=None, poll: float = 0.5, steps: int | None = None) -> int:
    """Run `cmd` (`loom rl`), turning each new step row of `metrics` into a row of `result` (rewritten to `out`
    at once); `started()`, if given, is called once `cmd` runs. Once `steps` rows are in, the run is ended
    (what loom does after its last step, a final evaluation, is not measured) and 0 returned. A non-zero
    exit, `timeout` seconds passed, or a SIGTERM of this process: an error row after the finished ones,
    written before the run is killed. Returns the exit status of `cmd` (-1 when it was stopped)."""
    rows = result.setdefault("rows", [])
    start = time.perf_counter()
    code, error = -1, None

    def on_term(signum, frame):
        raise CutOff

    previous = signal.signal(signal.SIGTERM, on_term)
    # The child stays in this process group: a `timeout` that kills the group (the device check's) takes it too.
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            if started is not None:
                started()
            while True:
                code = proc.poll()
                collect(metrics, rows, warmup)
                if rows and "startup_s" not in result:  # when step 1 began, to within one poll
                    result["startup_s"] = round(time.perf_counter() - start - rows[0]["step_s"], 2)
                write(out, result)
                if steps is not None and len(rows) >= steps:
                    code = 0
                    break
                if code is not None:
                    break
                if timeout is not None and time.perf_counter() - start > timeout:
                    error = f"cut off: loom rl still running after --timeout {timeout:g} s"
                    break
                time.sleep(poll)
        except CutOff:
            error = "cut off: this script was terminated (SIGTERM) while loom rl ran"
        except Exception as e:  # this script's own failure (an unreadable metrics line, ...): still a row
            error = f"rl_gpu.py failed while loom rl ran: {type(e).__name__}: {e}"
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not lose the rows
        try:
            try:
                collect(metrics, rows, warmup)
            except Exception:  # the error above, again: the rows collected so far stand
                pass
            if error is None and code != 0:
                log_file.flush()
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                error = f"loom rl exited with {code}: " + "\n".join(tail)[-2000:]
            if error is not None:
                rows.append({"error": error, "after_s": round(time.perf_counter() - start, 2)})
            result["summary"] = summary(rows)
            write(out, result)
        finally:
            if proc.poll() is None:  # killed, not stopped: a SIGTERM'd loom would finish its step and checkpoint
                proc.kill()
                proc.wait()
            signal.signal(signal.SIGTERM, previous)
    return code


def collect(metrics: Path, rows: list[dict], warmup: int) -> None:
    """`rows` made again from every complete step line of `metrics`, the new ones printed. Replaced in one
    assignment, so a SIGTERM arriving anywhere in here leaves them whole (old or new, never doubled)."""
    if not metrics.is_file():
        return
    lines = metrics.read_text().split("\n")[:-1]  # the last piece: empty, or a line still being written
    found = [step_row(m, warmup) for m in map(json.loads, lines) if "step_time_s" in m and "generation_s" in m]
    new = found[len(rows):]
    rows[:] = found
    for row in new:
        print(json.dumps(row), flush=True)


def provenance(command: str) -> dict:
    """loom.provenance's stamp (machine, torch, commit, command, date), CUDA's version; the commit from
    $LOOM_COMMIT where the tree has no git (the device check's machine)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from loom.provenance import stamp

    out = stamp(command)
    if out["commit"] == "unknown" and os.environ.get("LOOM_COMMIT"):
        out["commit"] = os.environ["LOOM_COMMIT"]
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.2-1b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (rl.group_size)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new", type=int, default=512, help="response tokens at most (rl.max_new_tokens)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (train.micro_batch)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps before them, rows marked warmup")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the loom rl run; then its error row")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script runs")
    ap.add_argument("--mode", choices=["sync", "async"], default="sync",
                    help="rl.mode: async starts one generation process beside the trainer")
    ap.add_argument("--staleness", type=int, default=1, help="rl.max_staleness with --mode async")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    command = "python bench/rl_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        shape, cuda = "tiny", False
        args.prompts, args.group, args.prompt, args.new, args.micro_batch = 2, 4, 12, 8, 8
        args.steps, args.warmup = 2, 1
    else:  # train.device=cuda: without a CUDA device loom rl says so, and that is the error row
        shape, cuda = args.shape, True
    for name in ("prompts", "group", "prompt", "new", "micro_batch", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    with tempfile.TemporaryDirectory(prefix="rl-gpu-") as tmp:
        tmp = Path(tmp)
        write_task(tmp, SHAPES[shape]["vocab_size"], args.prompt, args.prompts * (args.warmup + args.steps), seed=0)
        overrides = settings(args, shape, tmp, cuda)
        procs = []
        if args.mode == "async":
            overrides += ["rl.mode=async", "rl.generation_ranks=1", f"rl.max_staleness={args.staleness}"]
            procs = ["--nproc", "2"]
        run_dir = tmp / "run"
        log = args.out.with_name(args.out.stem + "_loom_rl.log")  # beside the JSON: loom rl's own output
        cmd = [sys.executable, "-m", "loom.cli", "rl", "--config", "tiny-grpo", "--run-dir", str(run_dir), *procs,
               *[f"--{o}" for o in overrides]]
        # loom's cache: the caller's when LOOM_CACHE is set (a test session's, where the CPU decode kernels are
        # already built: building them again costs a smoke run most of its time), else a private one in tmp
        env = dict(os.environ, LOOM_CACHE=os.environ.get("LOOM_CACHE") or str(tmp / "cache"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tmp), str(ROOT), os.environ.get("PYTHONPATH")])))
        result = {"benchmark": "rl_gpu", "mode": args.mode, "shape": shape, "dtype": "bfloat16" if cuda else "float32",
                  "prompts_per_step": args.prompts, "group_size": args.group, "prompt_tokens": args.prompt,
                  "max_new_tokens": args.new, "model": SHAPES[shape], "settings": overrides[len(SHAPES[shape]):],
                  "loom_rl_log": log.name, "rows": []}
        write(args.out, result)

        def stamped() -> None:  # once loom rl runs: this process's import of torch overlaps its start
            try:
                result.update(provenance(command))
            except Exception as e:  # the measurement goes on without its stamp
                result["provenance_error"] = f"{type(e).__name__}: {e}"

        code = run_and_collect(cmd, env, run_dir / "metrics.jsonl", log, args.out, result,
                               args.warmup, args.timeout, started=stamped, steps=args.warmup + args.steps)
        print(f"wrote {args.out}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
