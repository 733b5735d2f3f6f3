import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# `pytest -n N` (make test: two workers on two cores): each worker, and the processes it starts, gets its share of
# the cores, as loom.launch gives each rank. N workers of cpu_count threads each wait on one another at every
# parallel region: a tiny model's decode ran 35-80x slower (65 tokens: 1.2 s with two threads, 0.03 s with one,
# beside one busy process on two cores) and its training threads spun for 20 s of CPU over 2 s of work. Set
# before this worker imports torch; an OMP_NUM_THREADS given to pytest wins; tests that need more threads set
# them (torch.set_num_threads).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Tokenizers and token datasets built by the tests go to a private cache, shared by the session (and by the
    workers of `pytest -n`, as loom's cache is by concurrent runs: each file is written whole or not at all, the
    sample indices and the CPU kernels' build under a lock)."""
    old = os.environ.get("LOOM_CACHE")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base temporary folders share a parent
        cache = tmp_path_factory.getbasetemp().parent / "loom-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("loom-cache")
    os.environ["LOOM_CACHE"] = str(cache)
    yield
    if old is None:
        os.environ.pop("LOOM_CACHE", None)
    else:
        os.environ["LOOM_CACHE"] = old


# A small run that trains in a second or two: 2 layers, GQA, a 512-token BPE over 300 kB of corpus.
SMALL = [
    "model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
    "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=4",
    "train.global_batch=8", "train.steps=6", "train.eval_samples=8", "optim.warmup_steps=2",
    "optim.lr=3e-3", "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false",
]


def small_config(*extra: str):
    from loom.config import load_config

    return load_config("tiny", SMALL + list(extra))


def run_cli(*args: str):
    """Run `loom ...` in a subprocess; returns CompletedProcess with text output."""
    import subprocess

    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def run_main(*args: str):
    """`loom ...` in this process (`loom.cli.main`), standard output and error captured: what `run_cli` returns,
    without a new interpreter's start and torch's import (about 1.5 s a call on 2 cores). For commands that
    leave no process-wide state behind (the planner); training runs use `main` or `run_cli`."""
    import contextlib
    import io
    import types

    from loom.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, a bad choice
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue(), args=args)


def bench_smoke(script: str, tmp_path, *args: str, timeout: float = 600, env=None) -> dict:
    """Run `bench/SCRIPT --smoke ARGS --out F` in its own process (environment `env`, default this one's); its
    JSON report (the run must exit 0)."""
    import json
    import subprocess

    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", *args, "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def byte_level_bpe(texts: list[str], vocab_size: int, specials: list[str]):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `texts` with `specials` as special tokens, built
    locally, for tests that need a tokenizer of their own (chat tokens, a given vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


def randomize_hf_weights(model):
    """Spread a freshly built transformers model's weights (norms around 1, biases and matrices random) so
    that parity checks see every parameter; returns the model in fp32 eval mode."""
    import torch

    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """loom's corpus BPE (512 tokens) saved as a tokenizer.json, so the embedded corpus is the data (the
    Hugging Face interop tests put it next to their tiny models)."""
    from loom.data.tokenizer import get_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    get_tokenizer("bpe", 512, 300000).save(path)
    return path


def save_hf_models(tmp_path_factory, kinds, make_model, tokenizer_file) -> dict:
    """{kind: (directory written by save_pretrained with tokenizer.json, the transformers model)}."""
    out = {}
    for kind in kinds:
        model = make_model(kind)
        path = tmp_path_factory.mktemp(kind) / "hf"
        model.save_pretrained(path)
        (path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
        out[kind] = (path, model)
    return out


# The files that take longest on 2 cores (rank processes, subprocesses, compiling), longest first: they run first,
# so that `make test`'s two workers (pytest -n 2 --dist loadfile) end together instead of one waiting for the
# other's last long file. A file not named keeps its place after them.
LONG_FIRST = ["test_tied_pipeline", "test_device_check", "test_faults", "test_parallel", "test_checkpoint", "test_plan",
              "test_bench_serve_load", "test_compile_layouts", "test_run_control", "test_compile_cache",
              "test_pretrained", "test_run_length", "test_bench_gpu_train", "test_readme", "test_bench_generate_gpu",
              "test_moe_ep", "test_memory", "test_cli", "test_lora", "test_serve", "test_meta_init",
              "test_layout_auto", "test_rl_environments", "test_structured", "test_host_syncs", "test_rl_dynamic",
              "test_serve_scoring", "test_speculative", "test_prefix_cache", "test_distopt", "test_rl_async_features",
              "test_zero"]


def pytest_collection_modifyitems(config, items):
    """Long files first (LONG_FIRST). Tests marked `gpu` are the ones a GPU run must pass (`pytest -m gpu`, run by
    bench/device_check.sh); without a CUDA device they are skipped here, with the reason, instead of each
    repeating a skipif."""
    import torch

    order = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: order.get(Path(str(item.fspath)).stem, len(order)))  # stable: in-file order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device (run by bench/device_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def saved_bytes(model, *args) -> int:
    """Bytes one forward of `model(*args)` saves for backward, counted with saved-tensor hooks: each storage once,
    the model's parameters left out (the compiled-block activation tests' count)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(saved.values())
