"""The rule book: which parallel layouts loom runs, in one place, without torch.

Every part that needs a layout fact asks here: config validation (`Config.validate`), the launcher
(before any worker exists), the trainer and `loom memory` (through `parallel.dims.place_in_mesh`), the
pipeline runtime (chunk splits, which rank holds which chunk), the post-training recipes (what each runs
on, `recipe_problem`) and the planner (which tensor-parallel sizes, schedules and splits to search, and
whether loom can run a candidate). So `loom plan` never proposes what `loom train` refuses, and a refusal
names the field, its value and what would be valid.

The functions take plain values or any object with the config's attributes (`cfg.model`,
`cfg.parallel`, `cfg.train`, `cfg.recompute`); this module imports nothing from loom but its errors and
the pipeline facts (loom/pipeline_rules.py: layer splits, chunk owners, schedules), which it re-exports.
"""

from __future__ import annotations

import functools
import math

from loom.errors import UserError
from loom.optimizer_rules import distopt_problem, zero3_keeps_compute_rows  # noqa: F401
from loom.pipeline_rules import (SCHEDULES, chunk_layer_counts, chunk_owner, micro_batch_count_problem,  # noqa: F401
                                 micro_batches_needed, rank_chunks, schedule_problem, split_layers, split_problem,
                                 valid_split)


def divisors(n: int) -> list[int]:
    """n's divisors, ascending (none for n < 1)."""
    return list(_divisors(n))


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n >= 1 else []
    return (*small, *(n // d for d in reversed(small) if d * d != n))  # the search asks for seq_len's (8192+) often


def check_sizes(p) -> None:
    """Every parallel size is a positive integer."""
    sizes = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard,
             "cp": p.cp, "ep": p.ep}
    for name, size in sizes.items():
        if size <= 0:
            raise UserError(f"parallel.{name}={size} must be a positive integer")


# --- tensor parallelism ---------------------------------------------------------------------------


def tp_problems(tp: int, model, seq_len: int, sp: bool) -> list[str]:
    """Why `tp` cannot split this model (empty when it can): heads and key/value heads are split (not
    replicated), the embedding and head by vocabulary, the MLP by its hidden size, and under sequence
    parallelism the sequence."""
    reasons = []
    if model.heads % tp:
        reasons.append(f"it does not divide model.heads={model.heads}")
    if model.kv_heads % tp:
        reasons.append(f"it does not divide model.kv_heads={model.kv_heads} (key/value heads are split, not replicated)")
    if model.vocab_size % tp:
        reasons.append(f"it does not divide model.vocab_size={model.vocab_size} (the embedding and head are split by "
                       "vocabulary)")
    if model.ffn_hidden % tp:
        reasons.append(f"it does not divide model.ffn_hidden={model.ffn_hidden}")
    if sp and seq_len % tp:
        reasons.append(f"with parallel.sp=true it must divide train.seq_len={seq_len}")
    return reasons


def valid_tp_sizes(model, seq_len: int, sp: bool) -> list[int]:
    return [d for d in divisors(model.heads) if not tp_problems(d, model, seq_len, sp)]


def sp_problem(tp: int, sp: bool) -> str | None:
    """Sequence parallelism shards the sequence over the tensor-parallel group, so it needs one."""
    if sp and tp == 1:
        return ("parallel.sp=true shards the sequence across the tensor-parallel group, so it needs "
                "parallel.tp > 1; set parallel.sp=false or raise parallel.tp")
    return None


# --- mixture of experts ------------------------------------------------------------------------------


def moe_problem(experts: int, pp: int, schedule: str, cp: int, capacity_factor: float) -> str | None:
    """Which layouts a mixture-of-experts model runs on (None: this one). Proven equal to one process:
    data parallelism, expert parallelism carved from it (`ep_problem`), pipeline parallelism (every stage
    counts its own layers' routing), tensor parallelism (with SP and ep > 1 a multiple of tp, each rank routes
    its own sequence shard to experts spread over tensor- and data-parallel ranks; otherwise the MoE layer is
    computed on every tensor-parallel rank, on the whole sequence), and context parallelism (the balance loss
    and Sinkhorn computed over the cp group's tokens)."""
    if not experts:
        return None
    if pp > 1 and schedule == "zero_bubble":
        return (f"parallel.schedule=zero_bubble with model.moe.experts={experts} is not supported yet (its split "
                "backward is not proven to carry the MoE auxiliary losses); set parallel.schedule=1f1b or "
                "interleaved")
    if cp > 1 and capacity_factor > 0:
        return (f"parallel.cp={cp} with model.moe.capacity_factor={capacity_factor} is not supported: each "
                "context-parallel rank holds part of every sequence, so an expert's capacity (and which tokens "
                "it keeps) would differ from one process; set model.moe.capacity_factor=0 (dropless) or "
                "parallel.cp=1")
    return None


def experts_span_tp(tp: int, sp: bool, ep: int) -> bool:
    """Whether the routed experts are spread over tensor- as well as data- and context-parallel ranks: under
    sequence parallelism (tp > 1, sp) with ep > 1 a multiple of tp, every rank routes its own sequence shard and
    an EP group is made of whole tensor-parallel groups (Megatron-Core's expert tensor parallelism 1).
    Otherwise every tensor-parallel rank computes the whole MoE layer and ep is carved from the data- and
    context-parallel ranks alone."""
    return tp > 1 and sp and ep > 1 and ep % tp == 0


def valid_ep_sizes(experts: int, dp_cp: int, tp: int = 1, sp: bool = False) -> list[int]:
    """Expert-parallel sizes for `experts` routed experts over dp_replicate x dp_shard x cp = `dp_cp` ranks
    (dividing dp_cp); under sequence parallelism (tp > 1, sp) also the multiples of tp dividing tp x dp_cp."""
    if not experts:
        return [1]
    sizes = {d for d in divisors(dp_cp) if experts % d == 0}
    if tp > 1 and sp:
        sizes |= {tp * d for d in divisors(dp_cp) if experts % (tp * d) == 0}
    return sorted(sizes)


def ep_problem(ep: int, experts: int, dp_replicate: int, dp_shard: int, cp: int, tp: int = 1, sp: bool = False,
               capacity_factor: float = 0.0) -> str | None:
    """Why `parallel.ep` cannot shard this model's experts (None when it can). ep does not multiply the world
    size; each EP rank holds experts / ep of the routed experts, and ep divides the expert count.

    - With parallel.sp=true (tp > 1) and ep a multiple of tp (`experts_span_tp`), each rank routes its own
      sequence shard and the experts are spread over tensor-, data- and context-parallel ranks together: ep
      divides tp x dp_replicate x dp_shard x cp, and the model is dropless (capacity_factor=0: a rank holds
      part of every sequence, so an expert's capacity would differ from one process's).
    - Otherwise ep ranks are carved from the data- and context-parallel ranks (every tensor-parallel rank
      computes the whole MoE layer on the whole sequence): ep divides dp_replicate x dp_shard x cp."""
    if ep == 1:
        return None
    dp_cp = dp_replicate * dp_shard * cp
    valid = ", ".join(map(str, valid_ep_sizes(experts, dp_cp, tp, sp)))
    if not experts:
        return (f"parallel.ep={ep} shards the routed experts of a mixture-of-experts model, but model.moe.experts=0 "
                "(a dense model); set parallel.ep=1 or model.moe.experts > 0")
    sizes = f"{dp_replicate} x {dp_shard} x {cp}"
    if experts_span_tp(tp, sp, ep):
        if (tp * dp_cp) % ep:
            return (f"parallel.ep={ep} with parallel.tp={tp} and parallel.sp=true spreads the experts over tensor- "
                    f"and data-parallel ranks, so it must divide tp x dp_replicate x dp_shard x cp = {tp} x {sizes} "
                    f"= {tp * dp_cp} (expert-parallel ranks are carved from them, not added); valid ep sizes for "
                    f"this layout: {valid}")
    elif dp_cp % ep:
        if tp > 1 and sp:
            return (f"parallel.ep={ep} with parallel.tp={tp} and parallel.sp=true must be a multiple of tp dividing "
                    f"tp x dp_replicate x dp_shard x cp = {tp} x {sizes} = {tp * dp_cp} (experts spread over "
                    f"tensor- and data-parallel ranks) or divide dp_replicate x dp_shard x cp = {dp_cp} (carved "
                    f"from the data- and context-parallel ranks); valid ep sizes for this layout: {valid}")
        hint = (", or set parallel.sp=true to spread the experts over the tensor-parallel ranks too"
                if tp > 1 and ep in valid_ep_sizes(experts, dp_cp, tp, True) else "")
        return (f"parallel.ep={ep} must divide dp_replicate x dp_shard x cp = {sizes} = {dp_cp} (expert-parallel "
                f"ranks are carved from the data- and context-parallel ranks, not added to them); valid ep sizes "
                f"for this layout: {valid}, or raise parallel.dp_shard (e.g. parallel.dp_shard="
                f"{ep * dp_shard // math.gcd(ep, dp_cp)}){hint}")
    if experts % ep:
        return (f"parallel.ep={ep} must divide model.moe.experts={experts} (every rank holds the same number of "
                f"experts); valid ep sizes for this layout: {valid}")
    if experts_span_tp(tp, sp, ep) and capacity_factor > 0:
        return (f"parallel.ep={ep} spread over tensor-parallel ranks (parallel.tp={tp}, parallel.sp=true) with "
                f"model.moe.capacity_factor={capacity_factor} is not supported: each rank routes part of every "
                "sequence, so an expert's capacity (and which tokens it keeps) would differ from one process; "
                "set model.moe.capacity_factor=0 (dropless), or an ep that divides dp_replicate x dp_shard x cp "
                "with parallel.sp=false")
    return None


# --- context parallelism ----------------------------------------------------------------------------
#
# cp ranks split every sequence into 2 x cp chunks, rank i holding chunks i and 2 x cp - 1 - i (load-balanced
# causal sharding); attention all-gathers keys/values over the cp group (loom/parallel/context.py). The cp
# ranks of a data-parallel rank read the same samples and join FSDP's shard group (`dp_shard x cp`).


def cp_problem(cp: int, seq_len: int, tp: int = 1, sp: bool = False) -> str | None:
    """Why `cp` cannot split sequences of `seq_len` tokens (None when it can): 2 x cp equal chunks, and under
    sequence parallelism a rank's seq_len / cp tokens split again over the tensor-parallel group."""
    if cp == 1:
        return None
    ok = [c for c in divisors(seq_len) if c > 1 and seq_len % (2 * c) == 0 and not (sp and (seq_len // c) % tp)]
    valid = ", ".join(map(str, [1, *ok[:8]])) + (", ..." if len(ok) > 8 else "")
    if seq_len % (2 * cp):
        return (f"parallel.cp={cp} cuts every sequence into 2 x cp = {2 * cp} equal chunks, but train.seq_len="
                f"{seq_len} is not divisible by {2 * cp}; valid cp sizes for this seq_len: {valid}")
    if sp and (seq_len // cp) % tp:
        return (f"parallel.cp={cp} with parallel.tp={tp} and parallel.sp=true splits each rank's train.seq_len / cp "
                f"= {seq_len // cp} tokens over the tensor-parallel group, which needs train.seq_len divisible by "
                f"cp x tp = {cp * tp}; valid cp sizes for this seq_len: {valid}")
    return None


def cp_feature_problem(cp: int, recompute_mode: str) -> str | None:
    """What context parallelism does not compose with yet (None: nothing in this config)."""
    if cp == 1:
        return None
    if recompute_mode in ("budget", "auto"):
        return (f"recompute.mode={recompute_mode} plans one rank's layers without context parallelism; with "
                f"parallel.cp={cp} use recompute.mode=none, selective or full")
    return None


def document_mask_problem(masked: bool, position: str, sp: bool) -> str | None:
    """Why document masking (packed SFT, data.document_mask) cannot run in this layout (None: it can)."""
    if masked and position == "learned" and sp:
        return ("packed sequences restart learned positions per document, which parallel.sp=true does not split "
                "by sequence yet; set parallel.sp=false, model.position=rope, sft.packing=false or "
                "data.document_mask=false")
    return None


# --- batch ------------------------------------------------------------------------------------------


def batch_problem(global_batch: int, micro_batch: int, dp: int, dp_detail: str = "") -> str | None:
    """Every data-parallel rank runs whole micro-batches: dp x micro_batch divides the global batch."""
    per_step = dp * micro_batch
    if global_batch % per_step == 0:
        return None
    valid = [b for b in range(per_step, 8 * per_step + 1, per_step)]
    return (f"train.global_batch={global_batch} is not divisible by data-parallel size {dp}{dp_detail} x "
            f"train.micro_batch={micro_batch} = {per_step}; valid global batches: {', '.join(map(str, valid))}, ...")


# --- the whole layout -----------------------------------------------------------------------------


def grads_stay_sharded(grad_accum: str, pp: int, micro_batches: int) -> bool:
    """Whether FSDP gradients stay sharded over a step's micro-batches, as loom runs it.

    "sharded" reduce-scatters every micro-batch; torch.distributed.pipelining reduces only after a
    stage's last micro-batch, so under pp > 1 gradients accumulate unsharded whatever the setting.
    One micro-batch is reduced at once in either case.
    """
    return micro_batches == 1 or (grad_accum == "sharded" and pp == 1)


def data_parallel_size(p) -> int:
    return p.dp_replicate * p.dp_shard


def world_size(p) -> int:
    """Processes a layout needs: tp x cp x pp x dp_replicate x dp_shard (ep is carved from dp x cp, or with
    sequence parallelism from tp x dp x cp: `ep_problem`)."""
    return p.tp * p.cp * p.pp * p.dp_replicate * p.dp_shard


def check_layout(cfg, world: int | None = None, recipe: str = "train") -> None:
    """Raise UserError naming the field, value and valid choices for a layout loom cannot run.

    `world`: the processes started (None: not checked). `recipe`: the subcommand that runs it (train, sft, rm,
    dpo, rl; `recipe_problem`).
    """
    p, m, t = cfg.parallel, cfg.model, cfg.train
    check_sizes(p)
    experts = m.moe.experts
    if problem := ep_problem(p.ep, experts, p.dp_replicate, p.dp_shard, p.cp, p.tp, p.sp,
                             m.moe.capacity_factor) or moe_problem(
            experts, p.pp, p.schedule, p.cp, m.moe.capacity_factor):
        raise UserError(problem)
    if problem := sp_problem(p.tp, p.sp):
        raise UserError(problem)
    if problem := cp_problem(p.cp, t.seq_len, p.tp, p.sp) or cp_feature_problem(
            p.cp, cfg.recompute.mode):
        raise UserError(problem)
    if problem := document_mask_problem(cfg.data.document_mask, m.position, p.sp):
        raise UserError(problem)
    if p.tp > 1:
        reasons = tp_problems(p.tp, m, t.seq_len, p.sp)
        if reasons:
            raise UserError(
                f"parallel.tp={p.tp} is not possible: {'; '.join(reasons)}; valid tp sizes for this model: "
                f"{', '.join(map(str, valid_tp_sizes(m, t.seq_len, p.sp)))}"
            )
    if problem := gpu_path_problem(p.tp, p.pp, explicit_loss_chunk(t.loss_chunk), t.fp8):
        raise UserError(problem)
    dp = data_parallel_size(p)
    detail = f" (dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard})"
    if problem := batch_problem(t.global_batch, t.micro_batch, dp, detail):
        raise UserError(problem)
    _check_pipeline(cfg)
    if world is not None and world_size(p) != world:
        raise UserError(
            f"the parallel sizes multiply to {world_size(p)} (tp={p.tp} x cp={p.cp} x pp={p.pp} x dp_replicate="
            f"{p.dp_replicate} x dp_shard={p.dp_shard}) but {world} processes were started; make the product "
            f"equal the process count (e.g. --nproc {world_size(p)}) or change the sizes"
        )
    if problem := recipe_problem(recipe, cfg):
        raise UserError(problem)
    lora = getattr(cfg, "lora", None)  # the planner's and memory's configs are full Configs; older callers' not
    if lora is not None and (problem := lora_problem(lora.rank, p.tp, t.fp8)):
        raise UserError(problem)
    if problem := distopt_problem(cfg):
        raise UserError(problem)


def adam_moment_bytes(state_dtype: str) -> int:
    """Bytes per trained parameter of AdamW's two moments (exp_avg, exp_avg_sq), kept in optim.state_dtype
    (loom/train/optim.py): the one formula for `loom memory`, the banner and the planner's memory and step time."""
    return 2 * (2 if state_dtype in ("bfloat16", "bf16") else 4)


def lora_bytes_per_param(dtype: str, state_dtype: str) -> tuple[int, int, int]:
    """Bytes held between steps per parameter: (a frozen base weight: train.dtype alone, no gradient, no
    optimizer state; a trained one: fp32 weight + fp32 gradient + AdamW's two moments; the same trained one in
    full fine-tuning). One formula for the banner, `loom memory` and the planner."""
    trained = 4 + 4 + adam_moment_bytes(state_dtype)
    return (2 if dtype in ("bfloat16", "bf16", "fp16", "fp8") else 4), trained, trained


def lora_problem(rank: int, tp: int, fp8: str) -> str | None:
    """Which runs LoRA adapters (lora.rank > 0) compose with (None: this one). Proven equal to one process: data
    parallelism, fully sharded (FSDP2 shards the frozen base and the adapters alike, mixed requires_grad in one
    unit) and pipeline parallelism (adapters live in their block, on its stage). Tensor parallelism would shard
    A and B as it shards the projection they sit on (ColwiseParallel splits every parameter of the module by
    rows), which is wrong for A; fp8 training replaces the linear layers the adapters sit on."""
    if rank <= 0:
        return None
    if tp > 1:
        return (f"lora.rank={rank} with parallel.tp={tp} is not supported: tensor parallelism would split the "
                "adapters' A matrices by rows as it splits their projections; set parallel.tp=1 and use "
                "parallel.dp_shard (FSDP shards the frozen base and the adapters)")
    if fp8 != "off":
        return (f"lora.rank={rank} with train.fp8={fp8} is not supported: fp8 training replaces the linear layers "
                "the adapters sit on; set train.fp8=off")
    return None


# --- post-training recipes --------------------------------------------------------------------------


def recipe_problem(recipe: str, cfg) -> str | None:
    """What a recipe does not run yet (None: it runs this config). SFT packing restarts positions per
    example (`document_mask_problem`). The preference recipes (rm, dpo) run on data parallelism only:
    per-sequence log-probs of vocabulary-sharded logits, the loss only on the last stage, and sequences split
    across ranks each need their own reduction; a batch holds whole pairs. RL runs on data and tensor
    parallelism; a step's sequences are whole groups of completions of one prompt, never straddling
    data-parallel ranks. Both compute whole logits."""
    p, t = cfg.parallel, cfg.train
    dp = data_parallel_size(p)
    if getattr(p, "distopt_shard_weights", False) and recipe not in ("train", "sft"):  # zero.py releases a weight
        # once its gradient is reduced; rm, dpo and rl run the model more than once per backward
        return (f"parallel.distopt_shard_weights=true runs loom train and loom sft only for now, not loom {recipe}; "
                "set parallel.distopt_shard_weights=false")
    if recipe == "sft":
        return document_mask_problem(cfg.sft.packing, cfg.model.position, p.sp)
    if recipe in ("rm", "dpo"):
        for name, size in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)):
            if size > 1:
                return (f"parallel.{name}={size}: the preference recipes (loom dpo, loom rm) run with data parallelism "
                        f"only for now (parallel.dp_shard, parallel.dp_replicate); set parallel.{name}=1")
        if t.micro_batch % 2 or (t.global_batch // dp) % 2:
            return (f"train.global_batch={t.global_batch} and train.micro_batch={t.micro_batch} count sequences, two "
                    f"per preference pair (chosen and rejected): the micro-batch and each of the {dp} data-parallel "
                    "ranks' share of the global batch must be even")
        if explicit_loss_chunk(t.loss_chunk):
            return (f"train.loss_chunk={t.loss_chunk}: the preference recipes compute whole logits; set "
                    "train.loss_chunk=0 or auto")
    if recipe == "rl":
        rl = cfg.rl
        if cfg.recompute.mode == "auto" and not cfg.recompute.memory_gib > 0:
            return ("recompute.mode=auto plans before loom rl builds its generation engine, key/value cache and "
                    "reference model, so it cannot take the device's free memory as training's; set "
                    "recompute.memory_gib to the memory training may use, or another recompute.mode")
        for name, size in (("pp", p.pp), ("cp", p.cp)):
            if size > 1:
                return (f"parallel.{name}={size}: loom rl runs the policy with data and tensor parallelism "
                        f"(parallel.dp_shard, dp_replicate, tp) for now; set parallel.{name}=1")
        if p.sp:
            return "parallel.sp=true: loom rl does not run sequence parallelism yet; set parallel.sp=false"
        if t.global_batch % rl.group_size:
            return (f"train.global_batch={t.global_batch} must be a multiple of rl.group_size={rl.group_size} (a "
                    "step's sequences are whole groups of completions of one prompt)")
        prompts = t.global_batch // rl.group_size
        if prompts % dp:
            return (f"train.global_batch / rl.group_size = {prompts} prompts per step must divide among the {dp} "
                    "data-parallel ranks (a group never straddles ranks)")
        per_rank = t.global_batch // dp
        if (prompts // dp) % rl.minibatches or (per_rank // rl.minibatches) % t.micro_batch:
            return (f"each rank's {prompts // dp} prompts ({per_rank} sequences) per step must split into "
                    f"rl.minibatches={rl.minibatches} minibatches of whole groups and whole "
                    f"train.micro_batch={t.micro_batch} micro-batches")
        if explicit_loss_chunk(t.loss_chunk):
            return f"train.loss_chunk={t.loss_chunk}: loom rl computes whole logits; set train.loss_chunk=0 or auto"
    return None


AUTO_LOSS_CHUNK = 8192  # train.loss_chunk=auto on a GPU: 1B on an H200, 1.2% faster than whole logits, 16.5 GiB less


def loss_chunk_tokens(loss_chunk: int | str, device_type: str, tp: int, pp: int) -> int:
    """The tokens per chunk `train.loss_chunk` means on `device_type` ("cuda"/"cpu") with this layout: a number as
    given; "auto" AUTO_LOSS_CHUNK on a GPU without tensor or pipeline parallelism (which do not take a chunked
    loss), else 0 (whole logits: on a CPU the chunks buy memory at a small cost in time)."""
    if loss_chunk != "auto":
        return int(loss_chunk)
    return AUTO_LOSS_CHUNK if device_type == "cuda" and tp == 1 and pp == 1 else 0


def explicit_loss_chunk(loss_chunk: int | str) -> int:
    """`train.loss_chunk` as the user set it: "auto" never asks for a chunked loss where none can run."""
    return 0 if loss_chunk == "auto" else int(loss_chunk)


def gpu_path_problem(tp: int, pp: int, loss_chunk: int, fp8: str) -> str | None:
    """Which layouts the chunked cross-entropy and fp8 linears compose with (None: this one). Per-block
    compilation (train.compile) composes with every layout (tests/test_compile_layouts.py)."""
    if loss_chunk and tp > 1:
        return (f"train.loss_chunk={loss_chunk} with parallel.tp={tp} is not supported: under tensor parallelism "
                "the LM head is split by vocabulary and the vocabulary-parallel loss already keeps only 1/tp of "
                "the logits per rank; set train.loss_chunk=0 or auto, or parallel.tp=1")
    if loss_chunk and pp > 1:
        return (f"train.loss_chunk={loss_chunk} with parallel.pp={pp} is not supported yet (the pipeline's last "
                "stage returns logits to the schedule's loss); set train.loss_chunk=0 or auto, or parallel.pp=1")
    if fp8 != "off" and tp > 1:
        return (f"train.fp8={fp8} with parallel.tp={tp} is not supported yet (fp8 tensor-parallel styles are not "
                "wired in); set train.fp8=off, or parallel.tp=1 (fp8 composes with dp_shard/dp_replicate)")
    return None


def compile_problem(schedule: str) -> str | None:
    """Where per-block compilation (train.compile) cannot run (None: it can). Every layout the rule book
    accepts compiles (tests/test_compile_layouts.py) except the zero-bubble schedule; `loom plan` prices
    blocks compiled on a GPU exactly where this returns None."""
    if schedule == "zero_bubble":
        return ("train.compile=true with parallel.schedule=zero_bubble is not supported: the schedule splits "
                "each stage's backward into an input pass and a weight pass, and a compiled block's backward "
                "is one graph, which would run whole in both; set parallel.schedule=1f1b or interleaved, or "
                "train.compile=false")
    return None


def _check_pipeline(cfg) -> None:
    p, t = cfg.parallel, cfg.train
    problem = schedule_problem(p.pp, p.vpp, p.schedule)
    split = split_problem(cfg.model.layers, p.pp, p.vpp, p.first_stage_layers, p.last_stage_layers,
                          p.embedding_in_split, p.loss_in_split)
    if p.pp == 1:
        if problem or split:
            raise UserError(problem or split)
        return
    if split:
        raise UserError(split)
    if t.compile and (problem_c := compile_problem(p.schedule)):
        raise UserError(problem_c)
    if cfg.recompute.mode in ("budget", "auto"):
        raise UserError(f"recompute.mode={cfg.recompute.mode} plans one rank's layers without pipeline stages; "
                        "with parallel.pp > 1 use recompute.mode=selective or full")
    if problem:
        raise UserError(problem)
    if problem := micro_batch_count_problem(p.pp, p.vpp, p.schedule, t.global_batch, data_parallel_size(p),
                                            t.micro_batch):
        raise UserError(problem)


def layout_problem(cfg, world: int | None = None, recipe: str = "train") -> str | None:
    """check_layout's refusal as text, or None when loom runs the layout (for the planner)."""
    try:
        check_layout(cfg, world, recipe=recipe)
    except UserError as exc:
        return str(exc)
    return None


def infer_dp_shard(p, nproc: int) -> tuple[int, str] | None:
    """With `--nproc N` and no data-parallel size given (both 1), the fully sharded data-parallel size
    that makes the layout fill N processes, and a line saying so (as Megatron infers its data-parallel
    size); None when nothing is to be inferred. UserError when the other sizes do not divide N."""
    if p.dp_replicate != 1 or p.dp_shard != 1:
        return None
    rest = p.tp * p.cp * p.pp
    if rest == nproc:
        return None
    if nproc % rest:
        raise UserError(
            f"--nproc {nproc} is not a multiple of tp={p.tp} x cp={p.cp} x pp={p.pp} = {rest}, so no data-parallel "
            f"size fills it; valid --nproc: {', '.join(str(rest * k) for k in range(1, 5))}, ..."
        )
    dp = nproc // rest
    return dp, (f"parallel.dp_shard={dp} inferred from --nproc {nproc} / (tp={p.tp} x cp={p.cp} x pp={p.pp}); "
                "set parallel.dp_shard or parallel.dp_replicate to choose otherwise")
