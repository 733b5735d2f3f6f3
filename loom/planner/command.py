"""`loom plan`: arguments and the command."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loom.errors import UserError

PRECISIONS = ("bf16", "fp16", "fp8", "fp32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a config name, or explicit sizes)")
    m.add_argument("--model", default=None, help="a config name in configs/ (gpt3-175b, llama2-7b, ...) or a .toml path")
    for flag, help_ in (("--layers", "transformer layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                        ("--kv-heads", "key/value heads (GQA; default = heads)"), ("--ffn", "MLP hidden size"),
                        ("--vocab", "vocabulary size")):
        m.add_argument(flag, type=int, default=None, help=help_)
    m.add_argument("--mlp", choices=["swiglu", "gelu"], default=None)
    m.add_argument("--norm", choices=["rmsnorm", "layernorm"], default=None)
    m.add_argument("--attention", choices=["flash", "math"], default=None,
                   help="fused (flash) attention, or the unfused softmax of older Megatron runs")
    m.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout probability")
    m.add_argument("--experts", type=int, default=None, help="mixture of experts: routed experts per MoE layer (0: dense)")
    m.add_argument("--top-k", type=int, default=None, help="mixture of experts: experts each token is routed to")
    m.add_argument("--moe-ffn", type=int, default=None, help="mixture of experts: hidden size of one expert (default --ffn)")
    m.add_argument("--shared-experts", type=int, default=None, help="mixture of experts: always-on shared experts")
    c = p.add_argument_group("cluster and batch")
    c.add_argument("--gpus", type=int, default=None, help="number of GPUs")
    c.add_argument("--gpu", default="h100", help="a100-40gb, a100-80gb, h100, h200, or a profile JSON (default h100)")
    c.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's train.seq_len)")
    c.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the config's)")
    c.add_argument("--precision", choices=PRECISIONS, default="bf16", help="matmul precision (fp8: linear layers)")
    c.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32", help="AdamW moment dtype")
    c.add_argument("--grad-accum", choices=["sharded", "unsharded"], default="sharded",
                   help="FSDP gradients between micro-batches, as loom's parallel.grad_accum (default sharded)")
    c.add_argument("--memory-margin", type=float, default=None, metavar="GIB",
                   help="GiB per GPU kept free beyond the modelled total (allocator caching, spikes); "
                        "default 5%% of the GPU's memory")
    c.add_argument("--framework", choices=["loom", "megatron"], default="loom",
                   help="whose memory to price: loom (default; what `loom memory` measures) or megatron "
                        "(Megatron-Core + Transformer Engine as NeMo runs it: fused norms/SwiGLU, fp8 weight caches, "
                        "fused cross-entropy); dp_style=distopt is loom's distributed optimizer under loom, Megatron's under "
                        "megatron; dp_style=zero3 (loom only) is loom's with sharded weights")
    c.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="Megatron's gradient buffer dtype (NeMo's performance recipes: bfloat16); loom keeps float32")
    c.add_argument("--tokens", type=float, default=None, help="training tokens, to report days to train")
    c.add_argument("--loss-chunk", default="auto", metavar="TOKENS",
                   help="LM head + loss this many tokens at a time, its gradients computed in forward (loom's "
                        "train.loss_chunk); 0: the whole micro-batch's logits; auto (default): as loom's default, "
                        "8192 on a GPU where tp = pp = 1, whole logits elsewhere and for Megatron's runtime")
    c.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="price compiled transformer blocks (loom's train.compile: elementwise ops fused by inductor); "
                        "auto (default): as loom's GPU path runs, compiled on a GPU in every layout but the "
                        "zero-bubble schedule, eager on a CPU profile")
    c.add_argument("--moe-imbalance", type=float, default=1.0,
                   help="mixture of experts: tokens routed to the busiest expert-parallel rank over the mean (default "
                        "1.0, balanced, as NVIDIA's published MoE benchmarks force); it scales that rank's expert work, "
                        "activations and all-to-all volume")
    c.add_argument("--moe-dispatcher", choices=["alltoall", "deepep"], default="alltoall",
                   help="mixture of experts: how tokens reach their experts' ranks: alltoall (default; loom's, "
                        "Megatron's alltoall dispatcher: every routed row sent) or deepep (Megatron's flex dispatcher "
                        "with DeepEP: a token crosses the network once per node it goes to)")
    c.add_argument("--ep-overlap-chunks", type=int, default=1, metavar="N",
                   help="mixture of experts: loom's expert exchange pipelined in N chunks with the experts' products "
                        "(parallel.ep_overlap_chunks; default 1, unpipelined)")
    c.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="gradients reduced after backward, not during it (Megatron-LM before 2023)")
    s = p.add_argument_group("search")
    s.add_argument("--layout", default=None, help="evaluate one layout: tp=8,pp=8,dp=16,vpp=1,mbs=1,sp=true,recompute=selective")
    s.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    s.add_argument("--cross-node-tp", action="store_true", help="allow tensor parallel groups larger than a node")
    s.add_argument("--max-micro-batch", type=int, default=16)
    s.add_argument("--runtime", choices=["loom", "any"], default="loom",
                   help="loom (default): only layouts loom's rule book accepts, i.e. what `loom train` runs; any: also "
                   "layouts other runtimes run (Megatron's distributed optimizer, fp8, context parallelism), marked *")
    s.add_argument("--recipe", choices=["train", "sft", "rm", "dpo", "rl"], default="train",
                   help="the loom command that will run the layout: only layouts it accepts are offered (loom dpo and "
                   "loom rm run data parallelism only; loom rl data and tensor parallelism)")
    s.add_argument("--lora-rank", "--lora.rank", dest="lora_rank", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R (0: full fine-tuning): the base frozen in the training dtype, no "
                   "gradients or optimizer state for it")
    s.add_argument("--lora-targets", "--lora.targets", dest="lora_targets", default="q_proj,k_proj,v_proj,o_proj",
                   help="with --lora-rank: the projections adapted, as lora.targets (default "
                   "q_proj,k_proj,v_proj,o_proj)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help='print {"candidates": [...]} (best first)')
    o.add_argument("--plot", type=Path, default=None, help="draw the top candidates' time and memory terms (PNG)")
    o.add_argument("--config", type=Path, default=None, help="write the best layout loom can run as a config TOML")
    i = p.add_argument_group("inference")
    i.add_argument("--inference", action="store_true", help="search inference layouts instead of training ones")
    i.add_argument("--input-len", type=int, default=1024)
    i.add_argument("--output-len", type=int, default=256)
    i.add_argument("--batch", type=int, default=256, help="largest batch to consider")
    h = p.add_argument_group("calibration")
    h.add_argument("--profile-hardware", type=Path, default=None, metavar="OUT.json",
                   help="measure this machine (GEMMs, memory bandwidth, collectives) and write a profile")
    h.add_argument("--validate", action="store_true", help="predict the published runs loom is checked against")
    h.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # a smaller grid (tests)
    h.add_argument("--internode-gbps", type=float, default=25.0, help="with --profile-hardware: network GB/s per GPU")


def build_workload(args):
    from loom.config import LoRAConfig, ModelConfig, load_config
    from loom.config.lora import check_lora_model, loom_targets
    from loom.planner.hardware import load_gpu
    from loom.planner.workload import Workload

    opts = vars(args)
    base = None
    if args.model:
        base = load_config(args.model)
        model = base.model
    else:
        missing = [f for f in ("layers", "hidden", "heads", "vocab") if opts[f] is None]
        if missing:
            raise UserError("give --model NAME (e.g. gpt3-175b, llama2-7b) or the sizes --layers --hidden --heads "
                            f"--vocab (missing: {', '.join('--' + f for f in missing)})")
        model = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                            kv_heads=args.kv_heads or args.heads, vocab_size=args.vocab,
                            ffn_hidden=args.ffn or 4 * args.hidden, mlp=args.mlp or "gelu",
                            norm=args.norm or "layernorm")
    overrides = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                 "ffn_hidden": args.ffn, "vocab_size": args.vocab, "mlp": args.mlp, "norm": args.norm}
    for key, value in overrides.items():
        if value is not None:
            setattr(model, key, value)
    if args.attention:
        model.attention = "math" if args.attention == "math" else "sdpa"
    if args.dropout is not None:
        model.dropout = model.attn_dropout = args.dropout
    for flag, key in (("experts", "experts"), ("top_k", "top_k"), ("moe_ffn", "ffn_hidden"),
                      ("shared_experts", "shared_experts")):  # flag -> field of model.moe
        if opts[flag] is not None:
            setattr(model.moe, key, opts[flag])
    if model.moe.experts or args.top_k is not None:
        model.validate()  # the rule book's MoE checks (top_k within the experts, ...): a UserError names the key
    if args.loss_chunk != "auto":
        if not args.loss_chunk.isdigit():
            raise UserError(f"--loss-chunk={args.loss_chunk} must be an integer >= 0 (0: the whole micro-batch's "
                            "logits) or auto")
        args.loss_chunk = int(args.loss_chunk)
    if args.ep_overlap_chunks < 1:
        raise UserError(f"--ep-overlap-chunks={args.ep_overlap_chunks} must be >= 1 (1: the exchange unpipelined)")
    if not args.moe_imbalance >= 1.0:
        raise UserError(f"--moe-imbalance={args.moe_imbalance} must be >= 1 (the busiest rank's tokens over the mean; "
                        "1 is balanced)")
    seq = args.seq or (base.train.seq_len if base else None)
    batch = args.global_batch or (base.train.global_batch if base else None)
    if seq is None or batch is None:
        raise UserError("give --seq and --global-batch (they default to the config's only with --model)")
    if args.gpus is None:
        raise UserError("give --gpus N, the number of GPUs to plan for")
    for name, value in (("--gpus", args.gpus), ("--seq", seq), ("--global-batch", batch), ("--top", args.top),
                        ("--max-micro-batch", args.max_micro_batch)):
        if value < 1:
            raise UserError(f"{name}={value} must be >= 1")
    model.max_seq_len = max(model.max_seq_len, seq)
    model.validate()
    gpu = load_gpu(args.gpu)
    gpu.peak(args.precision)  # a clear error when the GPU lacks the precision
    margin = round(0.05 * gpu.memory_gib, 1) if args.memory_margin is None else args.memory_margin
    if not 0 <= margin < gpu.memory_gib:
        raise UserError(f"--memory-margin={margin} GiB must be >= 0 and below the GPU's {gpu.memory_gib:.1f} GiB")
    lora = LoRAConfig(rank=args.lora_rank, targets=[t for t in args.lora_targets.split(",") if t])
    lora.validate()  # a UserError names lora.rank / lora.targets and what is valid
    check_lora_model(lora, model)
    return Workload(model=model, seq_len=seq, global_batch=batch, gpus=args.gpus, gpu=gpu, precision=args.precision,
                    state_dtype=args.state_dtype, overlap_grad_reduce=not args.no_overlap_grad_reduce,
                    grad_accum=args.grad_accum, memory_margin_gib=margin, framework=args.framework,
                    grad_dtype=args.grad_dtype, moe_imbalance=args.moe_imbalance,
                    moe_dispatcher=args.moe_dispatcher, ep_overlap_chunks=args.ep_overlap_chunks,
                    loss_chunk=args.loss_chunk, recipe=args.recipe, lora_rank=lora.rank, compile=args.compile,
                    lora_targets=tuple(loom_targets(lora.targets)) if lora.enabled else ()), args.model


def run(args, engine_probe=None) -> int:
    """`loom plan`. `engine_probe`: `profile_hardware`'s measurement of the generation engine (the CLI passes
    `loom.infer.probe.measure`; the planner does not import the engine)."""
    if args.profile_hardware:
        from loom.planner.profile import profile_hardware

        prof = profile_hardware(args.profile_hardware, args.internode_gbps, quick=args.quick, engine_probe=engine_probe)
        print(f"wrote {args.profile_hardware}: {prof['name']}, peaks {prof['peak_tflops']} TFLOP/s, "
              f"memory {prof['hbm_gbps']} GB/s, collectives {prof['nvlink_gbps']} GB/s")
        return 0
    if args.validate:
        from loom.planner.validation import measured_validation, validate

        rows = validate()
        measured = measured_validation(args.compile)
        if args.json:
            print(json.dumps({"runs": rows, "measured_runs": measured}, indent=1))
            return 0
        def table(rows: list[dict], routing: bool = False) -> None:
            print(f"{'run':<28} {'published s':>11} {'predicted s':>11} {'error':>7}  fits  layout chosen"
                  + ("                    routing" if routing else ""))
            for r in rows:
                lay = r["layout"]
                if lay is None:  # no completion of the published layout fits
                    print(f"{r['run']:<28} {r['published_s']:>11.3f} {'-':>11} {'-':>7}  NO    (predicted not to fit)")
                    continue
                chosen = f"mbs={lay.get('micro_batch')} vpp={lay.get('vpp')} {lay.get('schedule')}"
                print(f"{r['run']:<28} {r['published_s']:>11.3f} {r['predicted_s']:>11.3f} {100 * r['error']:>+6.1f}%  "
                      f"{'yes' if r['fits'] else 'NO':<4}  " + (f"{chosen:<28} {r['routing']}" if routing else chosen))

        def summary(rows: list[dict], what: str) -> str:
            errors = [abs(r["error"]) for r in rows if r["error"] is not None]
            return (f"{len(errors)} of {len(rows)} {what} predicted to fit; mean |step-time error| "
                    f"{100 * sum(errors) / max(1, len(errors)):.1f}%")

        table([r for r in rows if r["set"] == "published"])
        print(summary([r for r in rows if r["set"] == "published"], "published layouts"))
        print()
        print("Published Megatron-Core MoE runs with tensor parallelism (experts over tp x dp ranks; "
              "loom/planner/published.py published_moe_runs)")
        table([r for r in rows if r["set"] == "moe"], routing=True)
        moe_rows = [r for r in rows if r["routing"] and r["set"] != "moe-heldout"]
        print(summary(moe_rows, f"MoE layouts (these and the {len(moe_rows) - sum(r['set'] == 'moe' for r in rows)} "
                                "above)"))
        print()
        print("A wider set of published dense runs (issue 38; loom/planner/published.py published_wide_runs)")
        table([r for r in rows if r["set"] == "wide"])
        print(summary([r for r in rows if r["set"] == "wide"], "published layouts"))
        print()
        print("Held-out published MoE runs on H100 (issue 55: long sequences under CP, 32 pipeline stages, later "
              "Megatron-Bridge rows; loom/planner/published.py published_moe_heldout_runs)")
        table([r for r in rows if r["set"] == "moe-heldout"], routing=True)
        print(summary([r for r in rows if r["set"] == "moe-heldout"], "held-out MoE layouts"))
        if measured:
            print()
            print("loom's own runs on one GPU (loom/planner/measured_runs.json), predicted from that machine's profile; "
                  "memory: total less reserve vs max_memory_allocated")
            print(f"{'run':<28} {'measured s':>10} {'predicted':>9} {'error':>7} {'meas GiB':>8} {'predicted':>9} "
                  f"{'error':>7}")
            for r in measured:
                print(f"{r['run']:<28} {r['measured_s']:>10.3f} {r['predicted_s']:>9.3f} {100 * r['error']:>+6.1f}% "
                      f"{r['measured_gib']:>8.1f} {r['predicted_gib']:>9.1f} {100 * r['memory_error']:>+6.1f}%")
            print(f"mean |step-time error| {100 * sum(abs(r['error']) for r in measured) / len(measured):.1f}%, "
                  f"mean |memory error| {100 * sum(abs(r['memory_error']) for r in measured) / len(measured):.1f}%")
        return 0
    start = time.perf_counter()
    w, base_name = build_workload(args)
    if args.inference:
        if w.model.moe.experts:
            raise UserError("--inference does not model mixture-of-experts models yet (which experts a decode step "
                            "reads depends on the batch); plan their training, or use a dense model")
        return _run_inference(args, w)
    from loom.planner import report
    from loom.planner.search import parse_layout, search, search_layout

    if args.layout:  # the knobs given are fixed, the rest searched
        estimates, info = search_layout(w, parse_layout(args.layout, w.gpus), cross_node_tp=True,
                                        max_micro_batch=args.max_micro_batch)
        if estimates[0].fits and args.runtime == "loom":
            runnable = [e for e in estimates if report.loom_runnable(e, w) is None]
            estimates = runnable or estimates  # else show the best, with loom's reason below
    else:
        estimates, info = search(w, top=0, cross_node_tp=args.cross_node_tp, max_micro_batch=args.max_micro_batch)
        if estimates and args.runtime == "loom":  # never offer what `loom train` refuses
            verdicts = [(e, report.loom_runnable(e, w)) for e in estimates]
            runnable = [e for e, reason in verdicts if reason is None]
            if not runnable:
                why = "; ".join(f"{r['reason']} (fastest: {r['layout']}, {r['step_time_s']:.3f} s/step)"
                                for r in report.refused_faster(verdicts, None)) or verdicts[0][1]
                raise UserError(f"no layout loom can run fits: {why}; --runtime any shows the layouts other "
                                "runtimes run")
            info["fit_and_loom_runs"] = len(runnable)
            info["refused_faster"] = report.refused_faster(verdicts, runnable[0])
            estimates = runnable
        if not estimates:
            need = f"; the smallest layout needs {info['smallest_gib']:.1f} GiB" if info.get("smallest_gib") else ""
            raise UserError(f"no layout of this model fits {w.gpus} x {w.gpu.name} ({w.gpu.memory_gib:.1f} GiB each) at "
                            f"global batch {w.global_batch}{need}; add GPUs, use --state-dtype bfloat16, or a "
                            "larger-memory --gpu")
    elapsed = time.perf_counter() - start
    shown = estimates[: args.top]
    if args.config:
        runnable = [e for e in estimates if report.loom_runnable(e, w) is None]
        if not runnable:
            raise UserError(f"--config: no candidate can run in loom today ({report.loom_runnable(estimates[0], w)}); "
                            "nothing written")
        note = report.write_config(runnable[0], w, base_name, args.config)
    if args.plot:
        report.plot(shown, args.plot, w.usable_bytes / 2**30)
    if args.json:
        out = {"candidates": [{**e.to_json(), "loom_refuses": report.loom_runnable(e, w)} for e in shown],
               "model": {"params": _params(w), "seq_len": w.seq_len, "global_batch": w.global_batch},
               "cluster": {"gpus": w.gpus, "gpu": w.gpu.name, "precision": w.precision,
                           "memory_gib": w.gpu.memory_gib, "memory_margin_gib": w.memory_margin_gib},
               "search": {**info, "seconds": round(elapsed, 3)},
               "convention": "tflops_per_gpu and mfu count model FLOPs (loom.flops: full s x s attention, "
                             "no recomputation); mfu is against the dense peak of --precision"}
        if args.tokens:
            for c, e in zip(out["candidates"], shown):
                c["days"] = round(report.days(e, w, args.tokens), 3)
        print(json.dumps(out, indent=1))
        return 0
    print(f"{w.gpus} x {w.gpu.name}, {w.precision}, model {_params(w) / 1e9:.2f}B params, seq {w.seq_len}, "
          f"global batch {w.global_batch}: {info['considered']} layouts considered, {info['fit']} fit"
          + (f", {info['fit_and_loom_runs']} of them loom runs" if "fit_and_loom_runs" in info else "")
          + f" ({elapsed:.1f} s); a layout fits in {w.usable_bytes / 2**30:.1f} of {w.gpu.memory_gib:.1f} GiB "
          f"(--memory-margin {w.memory_margin_gib:.1f} GiB kept free)")
    if args.layout:
        searched = ", ".join(info.get("searched", [])) or "nothing (no completion fits: the given layout, priced)"
        print(f"--layout {args.layout}: fixed as given; searched {searched}")
    print(report.format_table(shown, w, args.tokens))
    refused: dict[str, list[int]] = {}
    for i, e in enumerate(shown, 1):
        if reason := report.loom_runnable(e, w):
            refused.setdefault(reason, []).append(i)
    for reason, rows in refused.items():  # only with --runtime any, or a --layout loom refuses
        print(f"loom cannot run #{', #'.join(map(str, rows))} yet: {reason}")
    for row in info.get("refused_faster", []):
        print(f"faster, but loom refuses it: {row['layout']} at {row['step_time_s']:.3f} s/step ({row['reason']})")
    print()
    print(report.format_terms(shown[0], w.gpu.memory_gib, w.memory_margin_gib))
    if note := report.eager_note(shown[0], w):
        print(note)
    if args.layout and not shown[0].fits:
        print("this layout does NOT fit in memory")
    if args.config:
        print(f"wrote {args.config} ({report.layout_name(runnable[0])})" + (f"; {note}" if note else ""))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _params(w) -> int:
    from loom.planner.params import total_params

    return total_params(w.model)


def _run_inference(args, w) -> int:
    from loom.planner.inference import format_inference, plot_inference, search_inference

    for name in ("input_len", "output_len", "batch"):
        if vars(args)[name] < 1:
            raise UserError(f"--{name.replace('_', '-')}={vars(args)[name]} must be >= 1")
    results = search_inference(w, args.input_len, args.output_len, args.batch)
    if not results:
        raise UserError(f"no inference layout fits {w.gpus} x {w.gpu.name}; add GPUs or lower --batch/--input-len")
    title = f"inference, {w.gpus} x {w.gpu.name}, {w.precision}, input {args.input_len}, output {args.output_len}"
    if args.plot:
        plot_inference(results, args.plot, title)
    if args.json:
        print(json.dumps({"candidates": [e.to_json() for e in results if e.pareto],
                          "all": len(results)}, indent=1))
        return 0
    print(f"{title}: {len(results)} layouts fit; the latency / throughput Pareto front:")
    print(format_inference(results))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0
