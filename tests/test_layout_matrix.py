"""The layout matrix: every parallel layout the rule book accepts is proven equal to one process, or refused.

The matrix is every combination of the parallel families (tp, sp, cp, pp, dp_shard, dp_replicate, ep; sizes 1
or 2, sp off or on, at most 8 processes) with tied or untied embeddings and a dense or mixture-of-experts
model. `loom.rules.check_layout` (what config validation and the launcher call) decides which are accepted.
Each accepted one (other than the single process itself) must be

(a) covered in `make test` by an equivalence test against one process, named in `DEDICATED`;
(b) run only in `make test-all` (marked slow), with the reason: a dedicated test named in `DEDICATED` whose
    reason is in `SLOW_REASONS`, or one of `MATRIX_RUN`, which `test_matrix_layout_matches_single_process`
    below trains against one process (the reason is `MATRIX_RUN_REASON`), in rank processes reused from one
    combination to the next;
(c) or refused by the rules.

`test_every_accepted_layout_is_proven_or_refused` fails when the rules accept a combination that neither table
names (a new family, or a refusal dropped), when a table names a combination the rules refuse, and when a named
test is missing, is marked differently from what the table says, or runs another layout than it claims (each
dedicated test's layout is read from its own module's parameters).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from pathlib import Path
from typing import NamedTuple

import pytest

from loom.config import load_config
from loom.errors import UserError
from loom.rules import check_layout, world_size
from test_moe_compose import ROUTERS as MOE_ROUTERS
from test_moe_parallel import assert_same_routing
from test_parallel import MODEL, assert_same_run, single_runs

# The matrix's model: test_parallel's, with 4 layers so that pp=2 splits it. MoE: top-2 of 8 experts, dropless,
# seed 1 (test_moe_compose.py says why: no token's second and third experts within rounding of each other).
BASE = MODEL + ["model.layers=4"]
MOE = MOE_ROUTERS["top2of8"]


class Combo(NamedTuple):
    tp: int
    sp: bool
    cp: int
    pp: int
    dp_shard: int
    dp_replicate: int
    ep: int
    tied: bool
    moe: bool

    @property
    def name(self) -> str:
        sizes = [f"tp{self.tp}" if self.tp > 1 else "", "sp" if self.sp else ""]
        sizes += [f"{k}{getattr(self, k)}" if getattr(self, k) > 1 else "" for k in
                  ("cp", "pp", "dp_shard", "dp_replicate", "ep")]
        model = f"{'tied' if self.tied else 'untied'}-{'moe' if self.moe else 'dense'}"
        return "-".join([model, *[s for s in sizes if s]])

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp_shard * self.dp_replicate

    def overrides(self) -> list[str]:
        """The matrix model in this layout (`loom train` overrides)."""
        return BASE + (MOE if self.moe else []) + [
            f"model.tie_embeddings={str(self.tied).lower()}", f"parallel.tp={self.tp}",
            f"parallel.sp={str(self.sp).lower()}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}",
            f"parallel.dp_shard={self.dp_shard}", f"parallel.dp_replicate={self.dp_replicate}", f"parallel.ep={self.ep}"]


def combo_of(overrides: list[str]) -> Combo:
    """The matrix combination a test's `loom train` overrides run."""
    cfg = load_config("tiny", overrides)
    p = cfg.parallel
    return Combo(p.tp, p.sp, p.cp, p.pp, p.dp_shard, p.dp_replicate, p.ep, cfg.model.tie_embeddings,
                 cfg.model.moe.experts > 0)


def matrix() -> dict[str, tuple[Combo, str | None]]:
    """name -> (combination, None if the rule book accepts it, else its refusal), for every combination of at
    most 8 processes."""
    out = {}
    for tied, moe in itertools.product((True, False), (False, True)):
        cfg = load_config("tiny", BASE + (MOE if moe else []) + [f"model.tie_embeddings={str(tied).lower()}"])
        for tp, sp, cp, pp, dp_shard, dp_replicate, ep in itertools.product(*[(1, 2)] * 7):
            sp = sp == 2
            combo = Combo(tp, sp, cp, pp, dp_shard, dp_replicate, ep, tied, moe)
            if combo.world > 8:
                continue
            p = dataclasses.replace(cfg.parallel, tp=tp, sp=sp, cp=cp, pp=pp, dp_shard=dp_shard,
                                    dp_replicate=dp_replicate, ep=ep)
            try:
                check_layout(dataclasses.replace(cfg, parallel=p), world_size(p))
                refusal = None
            except UserError as exc:
                refusal = str(exc)
            out[combo.name] = (combo, refusal)
    return out


# --- the tables -------------------------------------------------------------------------------------------

P, T, M = "tests/test_parallel.py::", "tests/test_tied_pipeline.py::", "tests/test_moe_compose.py::"
LAYOUT, PIPELINE = P + "test_layout_matches_single_process", P + "test_pipeline_layout_matches_single_process"
TIED_PIPE, MOE_LAYOUT = T + "test_tied_pipeline_matches_single_process", M + "test_moe_layout_matches_single_process"
MOE_DP = "tests/test_moe_parallel.py::test_moe_data_parallel_matches_single_process"
MOE_EP_TP = "tests/test_moe_ep_tp.py::test_experts_over_tp_match_single_process"

# combination -> the equivalence test that proves it (the first one, where several do).
DEDICATED = {
    # (a) in make test
    "tied-dense-cp2": f"{LAYOUT}[cp2]",
    "tied-dense-dp_shard2": f"{LAYOUT}[dp_shard2]",
    "tied-dense-dp_shard2-dp_replicate2": f"{LAYOUT}[hsdp2x2]",
    "tied-dense-tp2-sp-dp_shard2": f"{LAYOUT}[tp2-sp-dp_shard2]",
    "tied-dense-pp2": f"{TIED_PIPE}[pp2-1f1b]",
    "tied-dense-tp2-pp2": f"{TIED_PIPE}[tp2-pp2]",
    "tied-dense-tp2-sp-pp2": f"{TIED_PIPE}[tp2-sp-pp2]",
    "untied-dense-pp2": f"{PIPELINE}[pp2-1f1b]",
    "untied-dense-cp2-pp2": f"{PIPELINE}[pp2-cp2]",
    # Its first run, against one process: the final weights, and the losses and grad norms of steps 1-3 (the
    # rows it wrote before the resumed run appended its own).
    "untied-dense-tp2-pp2": P + "test_resume_across_layouts",
    "tied-moe-dp_shard2": f"{MOE_DP}[top2of8-dp_shard=2]",
    "tied-moe-dp_replicate2": f"{MOE_DP}[sinkhorn_top1-dp_replicate=2]",
    "tied-moe-dp_shard2-ep2": "tests/test_moe_ep.py::test_checkpoint_under_ep_resumes_under_another_ep",
    "untied-moe-pp2": f"{MOE_LAYOUT}[top2of8-pp2]",
    "untied-moe-cp2": f"{MOE_LAYOUT}[sinkhorn_top1-cp2]",
    "tied-dense-tp2-cp2-pp2": f"{TIED_PIPE}[tp2-pp2-cp2]",
    "tied-moe-tp2-pp2-dp_shard2-ep2": f"{T}test_tied_moe_pipeline_matches_single_process[tp2-pp2-dp_shard2-ep2]",
    # (b) dedicated, in make test-all only (SLOW_REASONS)
    "tied-dense-tp2": f"{LAYOUT}[tp2]",
    "tied-dense-tp2-sp": f"{LAYOUT}[tp2-sp]",
    "tied-dense-dp_replicate2": f"{LAYOUT}[dp_replicate2]",
    "tied-dense-tp2-dp_replicate2": f"{LAYOUT}[tp2-dp_replicate2]",
    "tied-dense-tp2-sp-cp2": f"{LAYOUT}[cp2-tp2-sp]",
    "tied-dense-cp2-dp_shard2": f"{LAYOUT}[cp2-dp_shard2]",
    "tied-dense-pp2-dp_shard2": f"{TIED_PIPE}[pp2-dp_shard2]",
    "untied-dense-tp2-sp-pp2": f"{PIPELINE}[pp2-tp2-sp]",
    "untied-dense-pp2-dp_shard2": f"{PIPELINE}[pp2-dp_shard2]",
    "untied-dense-tp2-sp-pp2-dp_shard2": f"{PIPELINE}[tp2-pp2-dp_shard2]",
    "untied-moe-tp2": f"{MOE_LAYOUT}[top2of8-tp2]",
    "untied-moe-tp2-sp": f"{MOE_LAYOUT}[top2of8-tp2-sp]",
    "untied-moe-cp2-ep2": f"{MOE_LAYOUT}[top2of8-ep2-cp2]",
    "untied-moe-pp2-dp_shard2-ep2": f"{MOE_LAYOUT}[top2of8-ep2-pp2]",
    "untied-moe-tp2-sp-dp_shard2-ep2": f"{MOE_LAYOUT}[top2of8-ep2-tp2-sp]",
    "untied-moe-tp2-sp-ep2": f"{MOE_EP_TP}[top2of8-tp2-sp-ep2]",
    "untied-moe-tp2-sp-pp2-ep2": f"{MOE_EP_TP}[top2of8-tp2-sp-ep2-pp2]",
}

_PIECEWISE = "over make test's time budget on 2 cores; the families it composes are proven in make test by "
SLOW_REASONS = {
    f"{LAYOUT}[tp2]": _PIECEWISE + "tied-dense-tp2-pp2 (tp without SP) and tied-dense-tp2-sp-dp_shard2",
    f"{LAYOUT}[tp2-sp]": _PIECEWISE + "tied-dense-tp2-sp-dp_shard2 and tied-dense-tp2-sp-pp2",
    f"{LAYOUT}[dp_replicate2]": _PIECEWISE + "tied-dense-dp_shard2-dp_replicate2 (HSDP replicates)",
    f"{LAYOUT}[tp2-dp_replicate2]": _PIECEWISE + "tied-dense-tp2-sp-dp_shard2 and tied-dense-dp_shard2-dp_replicate2",
    f"{LAYOUT}[cp2-tp2-sp]": _PIECEWISE + "tied-dense-cp2 and tied-dense-tp2-sp-dp_shard2",
    f"{LAYOUT}[cp2-dp_shard2]": _PIECEWISE + "tied-dense-cp2 and tied-dense-dp_shard2",
    f"{TIED_PIPE}[pp2-dp_shard2]": _PIECEWISE + "tied-dense-pp2 and untied-dense-cp2-pp2 (pp with FSDP's sharded "
                                                "gradients)",
    f"{PIPELINE}[pp2-tp2-sp]": _PIECEWISE + "tied-dense-tp2-sp-pp2",
    f"{PIPELINE}[pp2-dp_shard2]": _PIECEWISE + "untied-dense-cp2-pp2 and tied-dense-dp_shard2",
    f"{PIPELINE}[tp2-pp2-dp_shard2]": "8 processes, ~55 s; " + _PIECEWISE + "tied-dense-tp2-sp-pp2 and "
                                                                          "untied-dense-cp2-pp2",
    # MoE layers under tensor parallelism are proven in make test by tied-moe-tp2-pp2-dp_shard2-ep2 (8 processes).
    f"{MOE_LAYOUT}[top2of8-tp2]": _PIECEWISE + "tied-moe-tp2-pp2-dp_shard2-ep2 (MoE under tp, pp and ep)",
    f"{MOE_LAYOUT}[top2of8-tp2-sp]": "as top2of8-tp2; SP by tied-dense-tp2-sp-pp2",
    f"{MOE_LAYOUT}[top2of8-ep2-cp2]": _PIECEWISE + "untied-moe-cp2 and tied-moe-dp_shard2-ep2",
    f"{MOE_LAYOUT}[top2of8-ep2-pp2]": _PIECEWISE + "untied-moe-pp2 and tied-moe-dp_shard2-ep2",
    f"{MOE_LAYOUT}[top2of8-ep2-tp2-sp]": "as top2of8-tp2; ep by tied-moe-dp_shard2-ep2, experts over tp ranks by "
                                         "test_moe_ep_tp.py's one-step gradient test",
    # Experts spread over tp ranks (sp, ep > 1): make test proves tp2 x ep4 over dp_shard 2 by one step's
    # gradients against one process (test_experts_over_tp_gradients_when_ranks_get_no_tokens).
    f"{MOE_EP_TP}[top2of8-tp2-sp-ep2]": _PIECEWISE + "test_moe_ep_tp.py's one-step gradient test (tp2-sp-ep4 "
                                                     "over dp_shard2)",
    f"{MOE_EP_TP}[top2of8-tp2-sp-ep2-pp2]": _PIECEWISE + "test_moe_ep_tp.py's one-step gradient test and "
                                                         "untied-moe-pp2",
}

MATRIX_NODE = "tests/test_layout_matrix.py::test_matrix_layout_matches_single_process"
MATRIX_RUN_REASON = ("no dedicated test: trained here against one process (6 steps each, in rank processes reused "
                     "across combinations); together they take longer than make test's whole budget (on 2 shared "
                     "cores: 13 minutes for the 51 dense ones, about 50 for the 123 MoE ones), and each family they "
                     "compose is proven in make test on its own")
# (b) accepted combinations without a dedicated test, by model; each runs as MATRIX_NODE[name] in make test-all.
MATRIX_RUN = {
    "tied-dense": """
        cp2-dp_replicate2 cp2-pp2 pp2-dp_replicate2 tp2-cp2 tp2-dp_shard2 tp2-sp-dp_replicate2
        cp2-dp_shard2-dp_replicate2 cp2-pp2-dp_replicate2 cp2-pp2-dp_shard2 pp2-dp_shard2-dp_replicate2
        tp2-cp2-dp_replicate2 tp2-cp2-dp_shard2 tp2-dp_shard2-dp_replicate2 tp2-pp2-dp_replicate2 tp2-pp2-dp_shard2
        tp2-sp-cp2-dp_replicate2 tp2-sp-cp2-dp_shard2 tp2-sp-cp2-pp2 tp2-sp-dp_shard2-dp_replicate2
        tp2-sp-pp2-dp_replicate2 tp2-sp-pp2-dp_shard2
    """,
    "untied-dense": """
        cp2 dp_replicate2 dp_shard2 tp2 tp2-sp cp2-dp_replicate2 cp2-dp_shard2 dp_shard2-dp_replicate2
        pp2-dp_replicate2 tp2-cp2 tp2-dp_replicate2 tp2-dp_shard2 tp2-sp-cp2 tp2-sp-dp_replicate2 tp2-sp-dp_shard2
        cp2-dp_shard2-dp_replicate2 cp2-pp2-dp_replicate2 cp2-pp2-dp_shard2 pp2-dp_shard2-dp_replicate2
        tp2-cp2-dp_replicate2 tp2-cp2-dp_shard2 tp2-cp2-pp2 tp2-dp_shard2-dp_replicate2 tp2-pp2-dp_replicate2
        tp2-pp2-dp_shard2 tp2-sp-cp2-dp_replicate2 tp2-sp-cp2-dp_shard2 tp2-sp-cp2-pp2
        tp2-sp-dp_shard2-dp_replicate2 tp2-sp-pp2-dp_replicate2
    """,
    "tied-moe": """
        tp2-sp-ep2 tp2-sp-pp2-ep2
        cp2 cp2-ep2 dp_replicate2-ep2 pp2 tp2 tp2-sp cp2-dp_replicate2 cp2-dp_replicate2-ep2 cp2-dp_shard2
        cp2-dp_shard2-ep2 cp2-pp2 cp2-pp2-ep2 dp_shard2-dp_replicate2 dp_shard2-dp_replicate2-ep2 pp2-dp_replicate2
        pp2-dp_replicate2-ep2 pp2-dp_shard2 pp2-dp_shard2-ep2 tp2-cp2 tp2-cp2-ep2 tp2-dp_replicate2
        tp2-dp_replicate2-ep2 tp2-dp_shard2 tp2-dp_shard2-ep2 tp2-pp2 tp2-sp-cp2 tp2-sp-cp2-ep2
        tp2-sp-dp_replicate2 tp2-sp-dp_replicate2-ep2 tp2-sp-dp_shard2 tp2-sp-dp_shard2-ep2 tp2-sp-pp2
        cp2-dp_shard2-dp_replicate2 cp2-dp_shard2-dp_replicate2-ep2 cp2-pp2-dp_replicate2 cp2-pp2-dp_replicate2-ep2
        cp2-pp2-dp_shard2 cp2-pp2-dp_shard2-ep2 pp2-dp_shard2-dp_replicate2 pp2-dp_shard2-dp_replicate2-ep2
        tp2-cp2-dp_replicate2 tp2-cp2-dp_replicate2-ep2 tp2-cp2-dp_shard2 tp2-cp2-dp_shard2-ep2 tp2-cp2-pp2
        tp2-cp2-pp2-ep2 tp2-dp_shard2-dp_replicate2 tp2-dp_shard2-dp_replicate2-ep2 tp2-pp2-dp_replicate2
        tp2-pp2-dp_replicate2-ep2 tp2-pp2-dp_shard2 tp2-sp-cp2-dp_replicate2 tp2-sp-cp2-dp_replicate2-ep2
        tp2-sp-cp2-dp_shard2 tp2-sp-cp2-dp_shard2-ep2 tp2-sp-cp2-pp2 tp2-sp-cp2-pp2-ep2
        tp2-sp-dp_shard2-dp_replicate2 tp2-sp-dp_shard2-dp_replicate2-ep2 tp2-sp-pp2-dp_replicate2
        tp2-sp-pp2-dp_replicate2-ep2 tp2-sp-pp2-dp_shard2 tp2-sp-pp2-dp_shard2-ep2
    """,
    "untied-moe": """
        dp_replicate2 dp_replicate2-ep2 dp_shard2 dp_shard2-ep2 cp2-dp_replicate2 cp2-dp_replicate2-ep2
        cp2-dp_shard2 cp2-dp_shard2-ep2 cp2-pp2 cp2-pp2-ep2 dp_shard2-dp_replicate2 dp_shard2-dp_replicate2-ep2
        pp2-dp_replicate2 pp2-dp_replicate2-ep2 pp2-dp_shard2 tp2-cp2 tp2-cp2-ep2 tp2-dp_replicate2
        tp2-dp_replicate2-ep2 tp2-dp_shard2 tp2-dp_shard2-ep2 tp2-pp2 tp2-sp-cp2 tp2-sp-cp2-ep2
        tp2-sp-dp_replicate2 tp2-sp-dp_replicate2-ep2 tp2-sp-dp_shard2 tp2-sp-pp2 cp2-dp_shard2-dp_replicate2
        cp2-dp_shard2-dp_replicate2-ep2 cp2-pp2-dp_replicate2 cp2-pp2-dp_replicate2-ep2 cp2-pp2-dp_shard2
        cp2-pp2-dp_shard2-ep2 pp2-dp_shard2-dp_replicate2 pp2-dp_shard2-dp_replicate2-ep2 tp2-cp2-dp_replicate2
        tp2-cp2-dp_replicate2-ep2 tp2-cp2-dp_shard2 tp2-cp2-dp_shard2-ep2 tp2-cp2-pp2 tp2-cp2-pp2-ep2
        tp2-dp_shard2-dp_replicate2 tp2-dp_shard2-dp_replicate2-ep2 tp2-pp2-dp_replicate2 tp2-pp2-dp_replicate2-ep2
        tp2-pp2-dp_shard2 tp2-pp2-dp_shard2-ep2 tp2-sp-cp2-dp_replicate2 tp2-sp-cp2-dp_replicate2-ep2
        tp2-sp-cp2-dp_shard2 tp2-sp-cp2-dp_shard2-ep2 tp2-sp-cp2-pp2 tp2-sp-cp2-pp2-ep2
        tp2-sp-dp_shard2-dp_replicate2 tp2-sp-dp_shard2-dp_replicate2-ep2 tp2-sp-pp2-dp_replicate2
        tp2-sp-pp2-dp_replicate2-ep2 tp2-sp-pp2-dp_shard2 tp2-sp-pp2-dp_shard2-ep2
    """,
}
MATRIX_RUN_NAMES = [f"{model}-{sizes}" for model, line in MATRIX_RUN.items() for sizes in line.split()]


# --- the rule book against the tables ---------------------------------------------------------------------

def _overrides_of(node: str) -> list[str]:
    """The `loom train` overrides of the layout the dedicated test `node` runs, read from its module."""
    test, _, param = node.partition("[")
    param = param.rstrip("]")
    path, func = test.split("::")
    mod = importlib.import_module(Path(path).stem)
    if func == "test_layout_matches_single_process":
        return mod.MODEL + mod.LAYOUTS[param][1]
    if func == "test_pipeline_layout_matches_single_process":
        return mod.PIPE + mod.PIPE_LAYOUTS[param][1]
    if func == "test_resume_across_layouts":  # the run it saves (then resumes under cp2 x dp_shard2)
        return mod.PIPE + ["parallel.tp=2", "parallel.pp=2"]
    if func == "test_tied_pipeline_matches_single_process":
        return mod.TIED + mod.LAYOUTS[param][1]
    if func == "test_tied_moe_pipeline_matches_single_process":
        return mod.TIED + mod.MOE + mod.MOE_LAYOUTS[param][1]
    if func == "test_moe_data_parallel_matches_single_process":
        router, layout = next((r, lay) for r, lay in mod.CASES if f"{r}-{lay.split('.')[1]}" == param)
        return mod.MODEL + mod.ROUTERS[router] + [layout]
    if func in ("test_moe_layout_matches_single_process", "test_experts_over_tp_match_single_process"):
        router, _, layout = mod.CASES[param]
        return mod.PIPE + mod.ROUTERS[router] + layout
    if func == "test_checkpoint_under_ep_resumes_under_another_ep":  # its first run, against one process
        return mod.MODEL + mod.ROUTERS["top2of8"] + ["parallel.dp_shard=2", "parallel.ep=2"]
    raise AssertionError(f"{node}: no reader for this test's layout; add one to _overrides_of")


def _is_slow(node: str) -> bool:
    """Whether pytest deselects `node` under make test's `-m "not slow"`; AssertionError if it does not exist."""
    test, _, param = node.partition("[")
    param = param.rstrip("]")
    path, name = test.split("::")
    mod = importlib.import_module(Path(path).stem)
    func = getattr(mod, name, None)
    assert callable(func), f"{node}: no test function {name} in {path}"
    marks = [*getattr(func, "pytestmark", []), *getattr(mod, "pytestmark", [])]
    slow = any(m.name == "slow" for m in marks)
    parametrize = [m for m in marks if m.name == "parametrize"]
    if not param:
        assert not parametrize, f"{node}: {name} is parametrized; name one of its cases"
        return slow
    assert len(parametrize) == 1, f"{node}: expected one parametrize mark on {name}"
    ids = parametrize[0].kwargs.get("ids")
    for i, value in enumerate(parametrize[0].args[1]):
        if isinstance(value, pytest.ParameterSet):
            case_id, case_marks, values = value.id, value.marks, value.values
        else:
            case_id, case_marks, values = None, (), value if isinstance(value, tuple) else (value,)
        case_id = ids[i] if ids else case_id or "-".join(map(str, values))
        if case_id == param:
            return slow or any(m.name == "slow" for m in case_marks)
    raise AssertionError(f"{node}: {name} has no case {param!r}")


def test_every_accepted_layout_is_proven_or_refused():
    every = matrix()
    accepted = {name for name, (combo, refusal) in every.items() if refusal is None and combo.world > 1}
    named = set(DEDICATED) | set(MATRIX_RUN_NAMES)
    assert not set(DEDICATED) & set(MATRIX_RUN_NAMES), set(DEDICATED) & set(MATRIX_RUN_NAMES)
    assert len(MATRIX_RUN_NAMES) == len(set(MATRIX_RUN_NAMES))
    assert not accepted - named, (
        f"the rule book accepts {sorted(accepted - named)}, which no equivalence test covers: add a test (or a case of "
        "an existing parametrized one) to DEDICATED, or the name to MATRIX_RUN, or refuse it in loom/rules.py")
    assert not named - accepted, (f"the tables name {sorted(named - accepted)}, which the rule book refuses (or which are "
                                  "not combinations of the matrix): take them out")
    fast = []
    for name, node in DEDICATED.items():
        slow = _is_slow(node)  # first: it names a missing test
        assert combo_of(_overrides_of(node)) == every[name][0], f"{node} does not run {name}"
        if slow:
            assert SLOW_REASONS.get(node), f"{node} runs in make test-all only: give the reason in SLOW_REASONS"
        else:
            assert node not in SLOW_REASONS, f"{node} runs in make test; take it out of SLOW_REASONS"
            fast.append(name)
    assert set(SLOW_REASONS) <= set(DEDICATED.values()), set(SLOW_REASONS) - set(DEDICATED.values())
    for name in MATRIX_RUN_NAMES:
        assert _is_slow(f"{MATRIX_NODE}[{name}]"), name
    refused = sum(refusal is not None for _, refusal in every.values())
    print(f"layout matrix: {len(every)} combinations of at most 8 processes; {len(accepted)} accepted beyond one "
          f"process: {len(fast)} proven in make test, {len(accepted) - len(fast)} in make test-all only "
          f"({len(DEDICATED) - len(fast)} dedicated, {len(MATRIX_RUN_NAMES)} from this matrix); {refused} refused")


# --- the matrix's own runs (make test-all) -----------------------------------------------------------------

def _train(run_dir: str, overrides: list[str]) -> None:
    from loom.train.trainer import Trainer

    Trainer(load_config("tiny", overrides), run_dir, quiet=True).fit()


@pytest.fixture(scope="module")
def matrix_references(tmp_path_factory):
    """The single-process run of the matrix model, tied or untied, dense or MoE, made on first use."""
    runs = {f"{'tied' if t else 'untied'}-{'moe' if m else 'dense'}": Combo(1, False, 1, 1, 1, 1, 1, t, m).overrides()
            for t, m in itertools.product((True, False), (False, True))}
    return single_runs(tmp_path_factory, runs)


@pytest.fixture(scope="module")
def rank_pool():
    """`get(world)`: rank processes of that size, kept for the next combination of the same size (the cases
    run sorted by size); one pool at a time."""
    from distributed import RankPool

    held: dict = {}

    def get(world: int) -> RankPool:
        pool = held.get("pool")
        if pool is not None and (pool.world != world or not pool.alive):
            pool.close()
            pool = None
        if pool is None:
            pool = held["pool"] = RankPool(world)
        return pool

    yield get
    if held.get("pool") is not None:
        held["pool"].close()


def _by_world(name: str) -> int:
    return matrix_combo(name).world


def matrix_combo(name: str) -> Combo:
    model, _, sizes = name.partition("-")
    kind, _, sizes = sizes.partition("-")
    values = dict(tp=1, sp=False, cp=1, pp=1, dp_shard=1, dp_replicate=1, ep=1)
    for part in sizes.split("-"):
        if part == "sp":
            values["sp"] = True
        elif part:
            values[part[:-1]] = int(part[-1])
    return Combo(**values, tied=model == "tied", moe=kind == "moe")


@pytest.mark.slow  # MATRIX_RUN_REASON
@pytest.mark.parametrize("name", sorted(MATRIX_RUN_NAMES, key=_by_world))
def test_matrix_layout_matches_single_process(name, matrix_references, rank_pool, tmp_path):
    combo = matrix_combo(name)
    assert combo.name == name
    run_dir = tmp_path / "run"
    rank_pool(combo.world).run(_train, str(run_dir), combo.overrides() + ["train.collective_timeout_s=120"])
    reference = matrix_references(name.split("-", 2)[0] + "-" + name.split("-", 2)[1])
    assert_same_run(run_dir, reference)
    if combo.moe:
        assert_same_routing(run_dir, reference, "top2of8", moe_layers=4)
