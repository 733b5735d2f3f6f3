"""`loom generate`: continue prompts (or chat conversations) with a trained model on loom's engine, printed
(`--prompt`) or written record by record (`--input`/`--output`, the contract records of DESIGN.md §3)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loom.errors import UserError

DESCRIPTION = (
    "Continue --prompt with a trained model, or every record of --input (a .jsonl of {\"prompt\": str}) into "
    "--output with token ids and log-probabilities: greedy at --temperature 0, else sampled with top-k / top-p. "
    "Stops at --max-new-tokens, at the model's end-of-sequence tokens (end-of-document, tokenizer_config.json's "
    "eos_token, generation_config.json's eos_token_id, the chat template's end-of-turn), at --stop text, or at the "
    "model's context length (and says so). Examples: loom generate --checkpoint runs/t1 --prompt 'def ' "
    "--max-new-tokens 64; loom generate --checkpoint runs/t1 --input prompts.jsonl --output out.jsonl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (its latest checkpoint), a checkpoint step-N directory, a loom model "
                   "directory or a Hugging Face model directory")
    p.add_argument("--prompt", default=None, help="the text to continue (printed with its continuation)")
    p.add_argument("--input", default=None, help='batch mode: a .jsonl file of {"prompt": str} or chat {"messages": '
                   '[...]} records (rendered with the model\'s chat template and its generation prompt)')
    p.add_argument("--output", default=None, help="batch mode: the .jsonl file to write, one record per input record "
                   "in the same order: prompt, completion (text), tokens (generated ids), logprobs (one per token, "
                   "log-softmax of the model's logits at temperature 1), finish_reason (stop or length), with the "
                   "input record's other fields")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs, in fp32: auto (default) is the GPU when there is one, else the CPU")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="decode steps through torch.compile in batch buckets, compiled before the first request. "
                        "auto (default): on on a GPU, where each decode step then replays one CUDA graph instead "
                        "of the host dispatching every op, off on a CPU, where compiling costs more than it saves "
                        "(measurements: bench/README.md, generation). on ('--compile' alone) / off: always / never "
                        "(off on a GPU for a few short prompts: building compiles first)")
    p.add_argument("--sync-every", type=int, default=8,
                   help="decode steps run on the device between reads back to the host (default 8; 1 reads after "
                        "every step, which refills a slot freed by a stop token soonest)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this much probability")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling; record n of --input uses seed + n, "
                   "so its sample does not depend on the others")
    p.add_argument("--n", type=int, default=1, help="batch mode: samples per input record (default 1), written as N "
                   "consecutive records with \"sample\": 0..N-1; sample k of record n uses seed + n * N + k. The "
                   "engine prefills each prompt once and its samples share its keys and values (paged memory)")
    p.add_argument("--speculative", choices=["off", "ngram"], default="off",
                   help="speculative decoding: ngram drafts each step's next tokens by prompt lookup (the last few "
                        "tokens found earlier in the prompt or completion) and verifies them in one forward; greedy "
                        "output is unchanged, sampling keeps its distribution (default off)")
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="with --speculative: tokens drafted per request and step at most (default 4)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop a completion once its text contains TEXT (repeatable); the completion ends before it, "
                   "finish_reason stop. Generation also stops at the model's end-of-sequence and end-of-turn tokens")

def generate(args, extra) -> int:
    """`loom generate`: the prompts (or chat records), the engine, the printed or written completions."""
    from loom import load_model
    from loom.data.tokenizer import Tokenizer
    from loom.infer.batch import read_prompts
    from loom.infer.engine import Engine
    from loom.infer.sampling import SamplingParams
    from loom.post.chat import generation_prompts, stop_texts, stop_token_ids

    if extra:
        raise UserError(f"unrecognised arguments {' '.join(extra)}; see `loom generate --help`")
    if (args.prompt is None) == (args.input is None) or (args.input is None) != (args.output is None):
        raise UserError("give either --prompt TEXT (prints its continuation) or --input prompts.jsonl together with "
                        "--output out.jsonl (batch mode)")
    if args.max_new_tokens < 1 or args.max_batch < 1 or args.sync_every < 1 or args.n < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens}, --max-batch={args.max_batch}, "
                        f"--sync-every={args.sync_every} and --n={args.n} must be >= 1")
    if args.draft_tokens < 1:
        raise UserError(f"--draft-tokens={args.draft_tokens} must be >= 1 (tokens drafted per step by --speculative)")
    if args.n > 1 and args.input is None:
        raise UserError(f"--n={args.n} needs batch mode (--input/--output): each sample is written as a record")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise UserError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")
    stops = tuple(args.stop or ())
    if not all(stops):
        raise UserError("--stop takes a non-empty string (repeat it for several)")
    from loom.parallel.distributed import pick_device

    device = pick_device(args.device, "--device")
    records = [("--prompt", {"prompt": args.prompt})] if args.input is None else read_prompts(args.input)
    model = load_model(args.checkpoint, device=device)
    tok = Tokenizer.from_file(find_tokenizer(args.checkpoint))
    texts = generation_prompts(records, tok.path)
    context = model.cfg.max_seq_len
    ids = [tok.encode(t) for t in texts]
    for (where, _), prompt in zip(records, ids):
        if not prompt:
            raise UserError(f"{where} is empty; give some text to continue")
        if len(prompt) >= context:
            raise UserError(f"{where} is {len(prompt)} tokens; this model's context is {context} tokens, so the "
                            "prompt must be shorter")
    # Stops at the model's end-of-sequence and end-of-turn tokens (loom.post.chat.stop_token_ids), at an
    # end-of-turn the tokenizer spells in ordinary tokens (stop_texts), and at --stop.
    stop_ids = stop_token_ids(tok)
    stops = tuple(dict.fromkeys(stops + stop_texts(tok)))
    n = args.n  # samples per record, side by side: the engine prefills a prompt once for all of them
    records = [record for record in records for _ in range(n)]
    texts = [text for text in texts for _ in range(n)]
    ids = [prompt for prompt in ids for _ in range(n)]
    params = [SamplingParams(args.temperature, args.top_k, args.top_p, args.max_new_tokens, stop_ids, args.seed + i,
                             stops) for i in range(len(ids))]
    # The slab holds what these requests can reach, not the model's whole context.
    max_len = min(context, max(map(len, ids)) + args.max_new_tokens)
    engine = Engine(model, max_batch=min(args.max_batch, len(ids)), max_len=max_len, compile=args.compile,
                    sync_every=args.sync_every, decode=tok.decode, paged=n > 1, paged_read="gather",
                    speculative=args.speculative, draft_tokens=args.draft_tokens)
    if args.input is None:
        return _print_completion(args, tok, ids[0], engine.generate(ids, params)[0], context)
    inputs = [r if n == 1 else {**r, "sample": i % n} for i, (_, r) in enumerate(records)]
    return _generate_file(args, tok, inputs, texts, ids, params, engine)


def _print_completion(args, tok, prompt, done, context) -> int:
    print(args.prompt + done.text(tok.decode))
    if done.finish_reason == "context":
        print(f"loom generate: stopped after {len(done.tokens)} new tokens at the model's context length "
              f"(max_seq_len={context}, prompt {len(prompt)} tokens), before --max-new-tokens="
              f"{args.max_new_tokens}", file=sys.stderr)
    return 0


def _generate_file(args, tok, inputs, texts, ids, params, engine) -> int:
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from loom.infer.batch import write_records

    start = time.perf_counter()
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("generate", total=len(ids))
        results = engine.generate(ids, params, on_done=lambda i, done: bar.advance(task))
    records = []
    for record, done in zip(inputs, results):
        # "context" (the model's context length reached) is a length limit too: the records say stop or length.
        reason = "stop" if done.finish_reason == "stop" else "length"
        records.append({**record, "completion": done.text(tok.decode), "tokens": done.tokens,
                        "logprobs": done.logprobs, "finish_reason": reason})
    write_records(args.output, records)
    tokens = sum(len(done.tokens) for done in results)
    seconds = time.perf_counter() - start
    s = engine.stats
    spec = ""
    if s.get("spec_request_steps"):  # speculative: tokens each request gained per verified step
        spec = (f", {(s['spec_accepted_tokens'] + s['spec_request_steps']) / s['spec_request_steps']:.2f} tokens per "
                f"step, {s['spec_accepted_tokens']}/{s['spec_draft_tokens']} drafted tokens accepted")
    print(f"wrote {len(records)} completions ({tokens} tokens, {tokens / seconds:.1f} tokens/s{spec}) to {args.output}")
    return 0


def find_tokenizer(path: str) -> Path:
    from loom.interop import is_hf_dir
    from loom.models.io import resolve_model_dir

    from loom.interop.peft import is_peft_dir, peft_base

    if is_peft_dir(path):  # an adapter directory: its own tokenizer if it carries one, else its base's
        own = Path(path) / "tokenizer.json"
        return own if own.is_file() else find_tokenizer(str(peft_base(path)))
    directory = Path(path) if is_hf_dir(path) else resolve_model_dir(path)
    tok = directory / "tokenizer.json"
    if not tok.is_file():
        raise UserError(f"{directory} has no tokenizer.json, so its text cannot be encoded")
    return tok


