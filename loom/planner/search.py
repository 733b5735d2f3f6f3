"""Enumerate every valid training layout, price each with the cost model, rank the ones that fit."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from loom.config import ModelConfig
from loom.errors import UserError
from loom.rules import SCHEDULES, batch_problem, micro_batch_count_problem, micro_batches_needed
from loom.rules import divisors as _divisors
from loom.rules import cp_problem as rules_cp_problem
from loom.rules import schedule_problem, sp_problem, split_problem, tp_problems, valid_ep_sizes, valid_split
from loom.planner.layertime import head_times, layer_times
from loom.planner.memory import memory
from loom.planner.stages import max_chunk_layers, pipeline_ranks
from loom.planner.steptime import evaluate, with_te_kernels
from loom.planner.workload import GIB, Estimate, Layout, Workload

DP_STYLES = ("replicate", "distopt", "zero3", "fsdp")
RECOMPUTE = ("none", "selective", "full")


def tp_options(cfg: ModelConfig, gpus: int, node_size: int, cross_node_tp: bool) -> list[int]:
    """Tensor-parallel sizes the rule book allows for this model (sequence parallelism is checked per
    candidate, with the sequence length)."""
    out = []
    for t in _divisors(gpus):
        if tp_problems(t, cfg, 0, sp=False):
            continue
        if t > node_size and not cross_node_tp:
            continue
        out.append(t)
    return out


def pipeline_options(cfg: ModelConfig, pp: int, m: int, schedules=SCHEDULES,
                     vpp: int | None = None) -> list[tuple[str, int]]:
    """(schedule, vpp) pairs loom's pipeline accepts for `pp` stages and `m` micro-batches (splits are
    chosen later): the rule book's (loom.rules), the ones `loom train` checks. The search tries 2-8
    virtual stages; a given `vpp` (a published layout's 10 or 20) is tried as it is. pp x vpp may reach
    layers + 2 (the embedding and the loss counted as a layer each, `split_options`)."""
    if pp == 1:
        return [("1f1b", 1)]
    virtual = range(2, 9) if vpp is None else ([vpp] if vpp > 1 else [])
    options = [("1f1b", 1)] + [("interleaved", v) for v in virtual] + [("zero_bubble", 2)]  # ZB-V
    return [(sched, v) for sched, v in options
            if sched in schedules and pp * v <= cfg.layers + 2 and schedule_problem(pp, v, sched) is None
            and micro_batches_needed(pp, v, sched, m) is None]


def _bottleneck(layers: int, pp: int, vpp: int, schedule: str, first: int, last: int, head: float,
                embedding: bool = False, loss: bool = False):
    """(slowest rank's work in layer units, layers on rank 0) of a split, or None if impossible."""
    shapes = pipeline_ranks(layers, pp, vpp, schedule, first, last, 1, embedding, loss)  # rank 0's comes first
    if shapes is None:
        return None
    work = [s.layers + (head if s.head else 0.0) for s in shapes]
    return max(work), shapes[0].layers


ENDS = ((True, True), (False, True), (True, False))  # (embedding_in_split, loss_in_split) of Megatron's split


@lru_cache(maxsize=16384)
def split_options(layers: int, pp: int, vpp: int, schedule: str, head: float) -> tuple[tuple[int, int, bool, bool], ...]:
    """(first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split) splits worth pricing: the
    even one when it exists, the uneven one that best balances the ranks' work when it is faster (or when no
    even split exists), and Megatron's split counting the embedding and/or the loss as a layer when it is
    faster than both (or when neither exists: pp x vpp above the layer count).

    `head` is the LM head + loss time of a micro-batch in units of one layer's time: with a large
    vocabulary the last stage is the slowest, and giving its chunk fewer layers shortens every step
    (what Megatron users do by hand with --decoder-last-pipeline-num-layers). Ties go to the split with
    fewer layers on rank 0, which holds the most activations in flight.
    """
    if pp == 1:
        return ((0, 0, False, False),)
    chunks = pp * vpp
    even = _bottleneck(layers, pp, vpp, schedule, 0, 0, head)
    best, best_key = None, None
    # Ends of at most a chunk above the even share; with two chunks (no middle) any split of the layers.
    top = layers - 1 if chunks == 2 else -(-layers // chunks) + 1
    for first in range(1, top + 1):
        for last in ([layers - first] if chunks == 2 else range(1, top + 1)):
            b = _bottleneck(layers, pp, vpp, schedule, first, last, head)
            if b is not None and (best_key is None or (round(b[0], 6), b[1]) < best_key):
                best, best_key = (first, last), (round(b[0], 6), b[1])
    out = []
    if even is not None:
        out.append((0, 0, False, False))
    if best is not None and (even is None or best_key[0] < round(even[0], 6) - 1e-6):
        out.append((*best, False, False))
    # Megatron's split: the embedding's time is not priced (a lookup), so it only moves a layer off rank 0.
    ends, ends_key = None, None
    for embedding, loss in ENDS:
        b = _bottleneck(layers, pp, vpp, schedule, 0, 0, head, embedding, loss)
        if b is not None and (ends_key is None or (round(b[0], 6), b[1]) < ends_key):
            ends, ends_key = (0, 0, embedding, loss), (round(b[0], 6), b[1])
    keys = [k for k in ((round(even[0], 6), even[1]) if even else None, best_key if best else None) if k]
    if ends is not None and (not keys or ends_key[0] < min(keys)[0] - 1e-6):
        out.append(ends)
    return tuple(out)


def head_weight(w: Workload, tp: int, cp: int) -> float:
    """The LM head + loss time of a micro-batch over one layer's (forward + backward), to 0.1."""
    lt = layer_times(w, tp, cp, 1, False, "none")
    return round(sum(head_times(w, tp, cp, 1)) / (sum(lt.fwd.values()) + sum(lt.bwd.values())), 1)


def cp_problem(w: Workload, cp: int, tp: int = 1, sp: bool = False) -> str | None:
    """Why context parallelism of size `cp` cannot split this workload's sequences (the rule book's check)."""
    return rules_cp_problem(cp, w.seq_len, tp, sp)


def cp_options(w: Workload, cp_max: int) -> list[int]:
    """1, and the powers of two that leave every rank at least 1024 tokens of the sequence."""
    out = [1]
    c = 2
    while c <= cp_max and cp_problem(w, c) is None and w.seq_len // c >= 1024:
        out.append(c)
        c *= 2
    return out


def _min_full_layers(w: Workload, lay: Layout, capacity: float) -> int | None:
    """Fewest layers per chunk to recompute fully so the layout fits (block method), or None."""
    n = max_chunk_layers(w, lay)

    def fits(k: int) -> bool:
        return memory(w, replace(lay, recompute="full", recompute_layers=0 if k == n else k))["total"] <= capacity

    if not fits(n):
        return None
    lo, hi = 1, n  # memory falls as more layers are recomputed: bisect for the fewest that fit
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ep_options(cfg: ModelConfig, dp: int, cp: int, tp: int = 1, sp: bool = False) -> list[int]:
    """Expert-parallel sizes the rule book allows (loom.rules.valid_ep_sizes): the divisors of dp x cp, and
    under sequence parallelism (tp > 1, sp) the multiples of tp dividing tp x dp x cp (experts spread over
    tensor- and data-parallel ranks); each divides the expert count. [1] for a dense model."""
    return valid_ep_sizes(cfg.moe.experts, dp * cp, tp, sp) if cfg.moe.experts else [1]


def ep_problem(cfg: ModelConfig, ep: int, dp: int, cp: int, tp: int = 1, sp: bool = False) -> str | None:
    """Why `--layout ep=N` cannot be priced (None: it can), in --layout's names."""
    if ep != 1 and not cfg.moe.experts:
        return f"ep={ep} needs a mixture-of-experts model (model.moe.experts > 0); this model is dense, valid: ep=1"
    valid = ep_options(cfg, dp, cp, tp, sp)
    if ep in valid:
        return None
    where = f"divide dp x cp = {dp * cp}"
    if tp > 1 and sp:
        where += f" or be a multiple of tp={tp} dividing tp x dp x cp = {tp * dp * cp} (experts over tp and dp ranks)"
    hint = (f", or sp=true (experts spread over tensor- and data-parallel ranks: "
            f"{', '.join(map(str, ep_options(cfg, dp, cp, tp, True)))})"
            if tp > 1 and not sp and ep in ep_options(cfg, dp, cp, tp, True) else "")
    return f"ep={ep} must {where}, and divide the {cfg.moe.experts} experts; valid: {', '.join(map(str, valid))}{hint}"


def candidates(w: Workload, *, cross_node_tp: bool = False, cp_max: int = 8, max_micro_batch: int = 16,
               dp_styles=DP_STYLES, recompute_modes=RECOMPUTE, schedules=SCHEDULES, fixed: dict | None = None):
    """Yield every valid layout (fitting or not is decided by the caller); `fixed` prunes tp, cp and pp early."""
    cfg, gpus = w.model, w.gpus
    fixed = fixed or {}
    for tp in tp_options(cfg, gpus, w.gpu.node_size, cross_node_tp):
        if fixed.get("tp", tp) != tp:
            continue
        sp_options = [sp for sp in (False, True) if not sp_problem(tp, sp) and not tp_problems(tp, cfg, w.seq_len, sp)]
        for cp in cp_options(w, cp_max):
            if fixed.get("cp", cp) != cp:
                continue
            cp_sp = [sp for sp in sp_options if not cp_problem(w, cp, tp, sp)]
            # the head's weight against a layer as loom runs the layer, and as Megatron (distopt) runs it
            head, te_head = head_weight(w, tp, cp), head_weight(with_te_kernels(w), tp, cp)
            for pp in range(1, cfg.layers + 1):
                if gpus % (tp * cp * pp) or fixed.get("pp", pp) != pp:
                    continue
                dp = gpus // (tp * cp * pp)
                if w.global_batch % dp:
                    continue
                for mbs in _divisors(w.global_batch // dp):
                    if mbs > max_micro_batch:
                        break
                    m = w.global_batch // (dp * mbs)
                    for schedule, vpp in pipeline_options(cfg, pp, m, schedules, fixed.get("vpp")):
                        splits = split_options(cfg.layers, pp, vpp, schedule, head)
                        te_splits = split_options(cfg.layers, pp, vpp, schedule, te_head)
                        if given := _given_split(cfg.layers, pp, vpp, fixed):  # --layout names the split
                            splits = te_splits = given
                        for first, last, emb, loss in splits + tuple(s for s in te_splits if s not in splits):
                            for sp in cp_sp:
                                for style in (dp_styles if dp * cp > 1 else ("replicate",)):  # distopt/fsdp shard over dp x cp
                                    if schedule == "zero_bubble" and (style == "distopt" or w.framework == "megatron"):
                                        continue  # Megatron-Core's schedules are 1F1B and interleaved only
                                    megatron_split = style == "distopt" and w.framework == "megatron"
                                    if (first, last, emb, loss) not in (te_splits if megatron_split else splits):
                                        continue
                                    for ep in ep_options(cfg, dp, cp, tp, sp):
                                        if fixed.get("ep", ep) != ep:
                                            continue
                                        if style == "zero3" and (w.framework == "megatron" or tp * pp > 1):
                                            continue  # loom's sharded weights (loom.rules.distopt_problem)
                                        for rec in recompute_modes:
                                            yield Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, micro_batch=mbs,
                                                         sp=sp, recompute=rec, dp_style=style, schedule=schedule,
                                                         first_stage_layers=first, last_stage_layers=last,
                                                         embedding_in_split=emb, loss_in_split=loss)


SPLIT_FIELDS = ("first_stage_layers", "last_stage_layers", "embedding_in_split", "loss_in_split")


def _given_split(layers: int, pp: int, vpp: int, fixed: dict) -> tuple[tuple[int, int, bool, bool], ...] | None:
    """The split `--layout` fixes (any of SPLIT_FIELDS named; the others at their defaults), as the only one to
    price when it is valid; () when it is not; None when `--layout` leaves the split to the search."""
    if not any(k in fixed for k in SPLIT_FIELDS):
        return None
    split = (fixed.get("first_stage_layers", 0), fixed.get("last_stage_layers", 0),
             fixed.get("embedding_in_split", False), fixed.get("loss_in_split", False))
    if pp == 1:
        return ((0, 0, False, False),) if split == (0, 0, False, False) else ()
    return (split,) if valid_split(layers, pp * vpp, *split) is not None else ()


def _matches(lay: Layout, fixed: dict) -> bool:
    """Whether `lay` has every value `fixed` gives (Layout field -> value)."""
    return not fixed or replace(lay, **fixed) == lay


def search(w: Workload, *, fixed: dict | None = None, top: int = 10, **kwargs) -> tuple[list[Estimate], dict]:
    """Ranked estimates of the layouts that fit (best first), and counts of what was considered."""
    capacity = w.usable_bytes
    fixed = fixed or {}
    considered = fitting = 0
    smallest = None
    results: list[Estimate] = []
    knobs = {k: v for k, v in fixed.items() if k != "recompute_layers"}  # recompute_layers is set below
    for lay in candidates(w, fixed=fixed, **kwargs):
        if not _matches(lay, knobs):
            continue
        considered += 1
        if lay.recompute == "full":
            if "recompute_layers" in fixed:
                lay = replace(lay, recompute_layers=fixed["recompute_layers"])
            else:
                k = _min_full_layers(w, lay, capacity)
                n = max_chunk_layers(w, lay)
                lay = replace(lay, recompute_layers=0 if k in (None, n) else k)
        mem = memory(w, lay)
        if mem["total"] > capacity:
            smallest = mem["total"] if smallest is None else min(smallest, mem["total"])
            continue
        fitting += 1
        results.append(evaluate(w, lay, mem))
    results.sort(key=lambda e: e.step_time_s)
    return results[:top] if top else results, {"considered": considered, "fit": fitting,
                                                "smallest_gib": None if smallest is None else smallest / GIB}


def parse_layout(text: str, gpus: int) -> dict:
    """`tp=8,pp=8,dp=16,vpp=1,mbs=1,sp=true,recompute=selective` -> Layout fields."""
    names = {"tp": "tp", "pp": "pp", "dp": "dp", "vpp": "vpp", "cp": "cp", "ep": "ep", "mbs": "micro_batch",
             "micro_batch": "micro_batch", "sp": "sp", "recompute": "recompute", "recompute_layers": "recompute_layers",
             "dp_style": "dp_style", "style": "dp_style", "schedule": "schedule",
             "first": "first_stage_layers", "first_stage_layers": "first_stage_layers",
             "last": "last_stage_layers", "last_stage_layers": "last_stage_layers",
             "embedding_in_split": "embedding_in_split", "loss_in_split": "loss_in_split"}
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise UserError(f"--layout item {part!r} is not key=value; e.g. --layout tp=8,pp=8,dp=16,mbs=1,sp=true,recompute=selective")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in names:
            raise UserError(f"--layout key {key!r} is unknown; valid keys: {', '.join(sorted(names))}")
        field = names[key]
        if field in ("sp", "embedding_in_split", "loss_in_split"):
            if value.lower() not in ("true", "false", "1", "0"):
                raise UserError(f"--layout {key}={value!r} must be true or false")
            out[field] = value.lower() in ("true", "1")
        elif field == "recompute":
            if value not in RECOMPUTE:
                raise UserError(f"--layout recompute={value!r}; valid: {', '.join(RECOMPUTE)}")
            out[field] = value
        elif field == "dp_style":
            if value not in DP_STYLES:
                raise UserError(f"--layout dp_style={value!r}; valid: {', '.join(DP_STYLES)}")
            out[field] = value
        elif field == "schedule":
            if value not in SCHEDULES:
                raise UserError(f"--layout schedule={value!r}; valid: {', '.join(SCHEDULES)}")
            out[field] = value
        else:
            try:
                out[field] = int(value)
            except ValueError:
                raise UserError(f"--layout {key}={value!r} must be an integer") from None
            least = 0 if field in ("recompute_layers", "first_stage_layers", "last_stage_layers") else 1
            if out[field] < least:
                raise UserError(f"--layout {key}={value} must be >= {least}")
    if "dp" not in out:
        rest = out.get("tp", 1) * out.get("pp", 1) * out.get("cp", 1)
        if gpus % rest:
            raise UserError(f"--layout tp x pp x cp = {rest} does not divide --gpus {gpus}")
        out["dp"] = gpus // rest
    world = out.get("tp", 1) * out.get("pp", 1) * out.get("cp", 1) * out["dp"]
    if world != gpus:
        raise UserError(f"--layout tp x pp x cp x dp = {world} but --gpus is {gpus}; the product must equal the GPU count")
    if out["dp"] == 1:
        out.setdefault("dp_style", "replicate")  # nothing to shard across
    if out.get("vpp", 1) > 1 and "schedule" not in out:
        out["schedule"] = "interleaved"
    return out


def search_layout(w: Workload, fields: dict, **kwargs) -> tuple[list[Estimate], dict]:
    """`--layout`: the knobs given are fixed and the rest searched (data-parallel style, micro-batch,
    virtual stages, schedule, recomputation, an uneven split where the layers do not divide), fitting
    completions best first. When none fits, the layout with defaults for the rest (and the best uneven
    split if needed), priced to show by how much it misses."""
    kwargs = {**kwargs, "cp_max": max(kwargs.get("cp_max", 8), fields.get("cp", 1)),
              "max_micro_batch": max(kwargs.get("max_micro_batch", 16), fields.get("micro_batch", 1))}
    # sp left open: an ep that needs sp=true (experts over tp ranks) is priced with sp=true only
    if problem := ep_problem(w.model, fields.get("ep", 1), fields["dp"], fields.get("cp", 1), fields.get("tp", 1),
                             fields.get("sp", True)):
        raise UserError(f"--layout is not valid for this model: {problem}")
    results, info = search(w, fixed=fields, top=0, **kwargs)
    if results:
        named = set(fields) | (set(SPLIT_FIELDS) if any(k in fields for k in SPLIT_FIELDS) else set())  # one split
        return results, {**info, "searched": sorted(set(SEARCHED) - named)}
    fields = dict(fields)
    pp, vpp = fields.get("pp", 1), fields.get("vpp", 1)
    if not any(k in fields for k in SPLIT_FIELDS) and split_problem(w.model.layers, pp, vpp, 0, 0):
        schedule = fields.get("schedule", "1f1b")
        megatron_distopt = fields.get("dp_style") == "distopt" and w.framework == "megatron"
        kw = with_te_kernels(w) if megatron_distopt else w  # the head against the layer it runs
        options = split_options(w.model.layers, pp, vpp, schedule, head_weight(kw, fields.get("tp", 1), fields.get("cp", 1)))
        if options:
            fields.update(zip(SPLIT_FIELDS, options[-1]))
    try:
        estimate = evaluate_layout(w, fields)
    except UserError as exc:
        implied = [k for k in ("tp", "pp", "cp") if k not in fields]
        if not implied:
            raise
        raise UserError(f"{exc}; note that --layout fixes the mesh sizes it does not name at 1 "
                        f"({', '.join(f'{k}=1' for k in implied)}) and gives data parallelism the rest (dp={fields['dp']}): "
                        "name them too, e.g. --layout tp=8,pp=16,cp=1") from None
    return [estimate], {"considered": max(1, info["considered"]), "fit": 0, "searched": []}


SEARCHED = ("dp_style", "micro_batch", "vpp", "schedule", "recompute", "first_stage_layers", "embedding_in_split", "sp")


def evaluate_layout(w: Workload, fields: dict) -> Estimate:
    """Price one given layout (the `--layout` path); unspecified knobs take their defaults."""
    cfg = w.model
    lay = Layout(**fields)
    problems = []
    problems += [f"tp={lay.tp}: {reason}" for reason in tp_problems(lay.tp, cfg, w.seq_len, lay.sp)]
    split = split_problem(cfg.layers, lay.pp, lay.vpp, lay.first_stage_layers, lay.last_stage_layers,
                          lay.embedding_in_split, lay.loss_in_split)
    if split:  # in --layout's names
        problems.append(split.replace("parallel.first_stage_layers", "first").replace(
            "parallel.last_stage_layers", "last").replace("parallel.", ""))
    problem = schedule_problem(lay.pp, lay.vpp, lay.schedule)
    if problem:
        problems.append(problem.replace("parallel.", ""))
    problem = batch_problem(w.global_batch, lay.micro_batch, lay.dp)
    if problem is None:
        problem = micro_batch_count_problem(lay.pp, lay.vpp, lay.schedule, w.global_batch, lay.dp, lay.micro_batch)
    problems += [problem, sp_problem(lay.tp, lay.sp), cp_problem(w, lay.cp, lay.tp, lay.sp),
                 ep_problem(cfg, lay.ep, lay.dp, lay.cp, lay.tp, lay.sp)]
    problems = [p for p in problems if p]
    if problems:
        raise UserError("--layout is not valid for this model and batch: " + "; ".join(problems))
    return evaluate(w, lay)
