"""Multi-turn GRPO with a calculator tool on CPU, from one command (`make demo-rl-tools`): does tool use raise
held-out accuracy over the same model answering without the tool?

    .venv/bin/python bench/rl_tools_demo.py [--sft-steps 800] [--rl-steps 150] [--smoke] [--out ...json]

The task: 3-digit x 2-digit multiplication ("123*45="), which the tiny model (0.8M parameters, configs/
tiny-grpo-sft.toml's shape) does not learn to do in its head in a few hundred CPU steps (3-digit addition it
does: 98% held out after 800 steps, measured, so that task shows no room for a tool). Two prompt forms of the
same problem:

- direct, "123*45=": the model answers the product at once (no tool);
- with the tool, "[calc] 123*45=": the model may call loom.post.rl.tools:Calculator by writing
  "calc 123*45;" (";" is rl.stop, cut from the text the tool reads), the environment answers " = 5535\\n", and
  the model's next turn is its answer, "5535" (at most 2 model turns).

1. SFT warm start (`loom sft`, random initialisation) on correctly labelled direct examples plus a few tool
   transcripts ("[calc] A*B=" -> "calc A*B; = P\\nP", one in ten records), which teach the call format;
2. GRPO (`loom rl --rl.environment=loom.post.rl.tools:Calculator --rl.max_turns=2`, exact-match reward on
   the final answer, environment tokens masked out of the loss) on tool prompts only.

Evaluation (this script, greedy, the same held-out problems, never trained on: one in ten by a hash of the
text): exact match of (a) the direct answer and (b) the tool episode's final answer, of the SFT model and of
the RL model; plus how often the tool episode called the calculator. Writes the JSON (machine, torch, commit,
command, the accuracies, steps, wall times).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.post.tasks import held_out  # noqa: E402
from loom.provenance import stamp  # noqa: E402

QUIET = ["--log.progress=none", "--log.tensorboard=false"]
TOOL = "[calc] "
STOP = ";"  # ends a tool call (rl.stop; a newline would be stripped from the command line)


def run(command: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "loom.cli", *command], cwd=ROOT, check=True)
    return time.perf_counter() - t0


def problems(n: int, seed: int, valid: bool) -> list[tuple[str, str]]:
    """n distinct 3-digit x 2-digit problems "A*B=" with their products: held-out ones when `valid`, else none."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        prompt = f"{a}*{b}="
        if held_out(prompt) == valid and prompt not in seen:
            seen.add(prompt)
            out.append((prompt, str(a * b)))
    return out


def tool_transcript(prompt: str, answer: str) -> str:
    """The SFT target of a tool prompt: the call turn (ended by the rl.stop string STOP, which the engine cuts
    from the text the environment reads), the Calculator's reply to it, the answer turn."""
    return f"calc {prompt[:-1]}{STOP} = {answer}\n{answer}"


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def evaluate(run_dir: Path, valid: list[tuple[str, str]]) -> dict:
    """Greedy held-out exact match of `run_dir`'s model, (a) answering directly, (b) with the calculator."""
    import torch

    import loom
    from loom.data.tokenizer import Tokenizer
    from loom.infer.engine import Engine
    from loom.infer.sampling import SamplingParams
    from loom.post.rl.environments import Turns, run_episodes
    from loom.post.rl.tools import Calculator

    model = loom.load_model(run_dir)
    tok = Tokenizer.from_file(run_dir / "tokenizer.json")
    engine = Engine(model, max_batch=len(valid), max_len=64, decode=tok.decode)
    eod = (tok.eod_id,)
    with torch.no_grad():
        direct = engine.generate([tok.encode(p) for p, _ in valid],
                                 SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=eod))
        direct_hits = [c.text(tok.decode).strip() == a for (_, a), c in zip(valid, direct)]
        records = [{"prompt": TOOL + p, "answer": a} for p, a in valid]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=eod, stop=(STOP,), seed=0)
        params = [greedy] * len(valid)
        episodes = run_episodes(engine, Calculator, records, [f"held-out {i}" for i in range(len(valid))], params,
                                Turns(tok), max_turns=2, decode=tok.decode)
    called = [bool(e.observations) and e.observations[0].startswith(" = ") for e in episodes]
    return {"no_tool": round(sum(direct_hits) / len(valid), 3),
            "with_tool": round(sum(e.reward for e in episodes) / len(valid), 3),
            "tool_call_rate": round(sum(called) / len(valid), 3),
            "example_tool_transcript": TOOL + valid[0][0] + episodes[0].text(tok.decode)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--rl-steps", type=int, default=150)
    ap.add_argument("--held-out", type=int, default=300)
    ap.add_argument("--rl-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra `loom rl` overrides, e.g. optim.lr=3e-4 (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="a few steps end to end (tests): numbers meaningless")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rl_tools_demo.json"))
    args = ap.parse_args()
    if args.smoke:
        args.sft_steps, args.rl_steps, args.held_out = 4, 2, 16
    t_start = time.perf_counter()
    train, rl_problems = problems(6000, 0, False), problems(4000, 1, False)
    valid = problems(args.held_out, 2, True)
    sft_records = [{"prompt": p, "completion": a} for p, a in train[:5400]]
    sft_records += [{"prompt": TOOL + p, "completion": tool_transcript(p, a)} for p, a in train[5400:]]
    random.Random(3).shuffle(sft_records)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sft_data = write_jsonl(tmp / "sft.jsonl", sft_records)
        rl_data = write_jsonl(tmp / "rl.jsonl", [{"prompt": TOOL + p, "answer": a} for p, a in rl_problems])
        valid_data = write_jsonl(tmp / "valid.jsonl", [{"prompt": TOOL + p, "answer": a} for p, a in valid[:64]])
        sft_dir, rl_dir = tmp / "sft", tmp / "rl"
        sft = ["sft", "--config", "tiny-grpo-sft", "--run-dir", str(sft_dir), f"--sft.data={sft_data}",
               f"--train.steps={args.sft_steps}", f"--train.eval_interval={max(args.sft_steps, 1)}", *QUIET]
        rl = ["rl", "--config", "tiny-grpo", "--run-dir", str(rl_dir), f"--train.init_from={sft_dir}",
              f"--rl.prompts={rl_data}", f"--rl.valid_prompts={valid_data}", "--rl.reward=",
              "--rl.environment=loom.post.rl.tools:Calculator", "--rl.max_turns=2", f"--rl.stop={STOP}",
              "--rl.max_new_tokens=16", "--train.seq_len=64", "--train.micro_batch=128", "--train.global_batch=256",
              "--rl.engine_batch=256", f"--train.steps={args.rl_steps}",
              f"--train.eval_interval={max(args.rl_steps, 1)}", *QUIET,
              *(f"--{o.removeprefix('--')}" for o in args.rl_override)]
        sft_s = run(sft)
        before = evaluate(sft_dir, valid)
        rl_s = run(rl)
        after = evaluate(rl_dir, valid)
        rows = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    total = time.perf_counter() - t_start
    raised = {k: round(100 * (v["with_tool"] - v["no_tool"]), 1) for k, v in (("sft", before), ("rl", after))}
    result = {
        "what": "3-digit x 2-digit multiplication, held-out greedy exact match of the same tiny model (0.8M "
                "parameters) answering directly (no tool) and with loom.post.rl.tools:Calculator (up to 2 turns: "
                "'calc A*B;', the tool's ' = P', the answer), after an SFT warm start (5400 direct examples, 600 tool "
                "transcripts) and after GRPO with the calculator environment on tool prompts",
        "smoke": args.smoke,
        "held_out_problems": len(valid),
        "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
        "held_out_accuracy": {"sft": before, "rl": after},
        "tool_minus_no_tool_points": raised,
        "tool_raises_accuracy": {k: v > 0 for k, v in raised.items()},
        "sft_wall_s": round(sft_s, 1), "rl_wall_s": round(rl_s, 1), "total_wall_s": round(total, 1),
        "rl_mean_step_s": round(sum(r.get("step_time_s", 0.0) for r in steps) / max(len(steps), 1), 3),
        "train": [{k: round(r[k], 5) for k in ("step", "reward", "loss") if k in r} for r in steps],
        **stamp(" ".join(["bench/rl_tools_demo.py", *sys.argv[1:]]) + "  (runs: loom " + " ".join(sft)
                + " ; loom " + " ".join(rl) + ")"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}: held-out exact match, SFT: no tool {before['no_tool']:.3f}, "
          f"with tool {before['with_tool']:.3f}"
          f"; after RL: no tool {after['no_tool']:.3f}, with tool {after['with_tool']:.3f}; {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
