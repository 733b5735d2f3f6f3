"""The `loom` command end to end: exit codes, messages, and that bad input leaves nothing behind."""

import json

import pytest

from conftest import SMALL, run_cli
from loom.cli import main

SMALL_ARGS = [f"--{o}" for o in SMALL]


def fails(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


def test_console_exit_code_and_no_traceback():
    proc = run_cli("train", "--config", "tinny")
    assert proc.returncode == 2
    assert "did you mean 'tiny'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("generate", "--checkpoint", "/nonexistent/run", "--prompt", "x")
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--train.stpes=3"], ["train.stpes", "train.steps"]),
        (["--optim.lr=-0.1"], ["optim.lr=-0.1"]),
        (["--optim.lr=0"], ["optim.lr=0"]),
        (["--train.global_batch=10", "--train.micro_batch=4"], ["global_batch=10", "micro_batch=4"]),
        (["--data.paths=/nonexistent/corpus"], ["/nonexistent/corpus"]),
        (["--train.steps"], ["has no value"]),
        (["stray"], ["unrecognised argument 'stray'"]),
    ],
)
def test_train_bad_input(capsys, tmp_path, extra, fragments):
    run_dir = tmp_path / "run"
    fails(capsys, ["train", "--config", "tiny", "--run-dir", str(run_dir), *SMALL_ARGS, *extra], *fragments)
    assert not run_dir.exists()


@pytest.mark.parametrize("arg, meant", [
    ("--learning_rate=2e-5", "--optim.lr=VALUE"),
    ("--bf16", "--train.dtype=bfloat16"),
    ("--lr_scheduler_type=cosine", "--optim.decay=cosine, linear or constant"),
    ("--num_train_epochs=3", "--train.steps=N: loom counts optimizer steps, N = epochs x examples / train.global_batch"),
    ("--warmup_ratio=0.1", "--optim.warmup_steps=N, N = ratio x train.steps"),
    ("--lora_r=16", "--lora.rank=VALUE"),
    ("--gradient-accumulation-steps=4", "--train.global_batch=G and --train.micro_batch=M"),
    ("--output_dir", "--run-dir VALUE"),
])
def test_trl_argument_names_get_the_loom_key_they_mean(capsys, tmp_path, arg, meant):
    """TRL / transformers spellings exit 2 naming what to write instead, before anything runs."""
    run_dir = tmp_path / "run"
    name = arg.split("=")[0].removeprefix("--").replace("-", "_")
    fails(capsys, ["sft", "--config", "tiny-sft", "--run-dir", str(run_dir), arg, "--train.steps=1"],
          f"unrecognised argument '{arg}': {name} is what Hugging Face / TRL call it; in loom write {meant}")
    assert not run_dir.exists()


def test_tokenizer_larger_than_embedding(capsys, tmp_path):
    from loom.data.tokenizer import train_bpe

    tok = train_bpe(512, max_bytes=100_000)
    tok.save(tmp_path / "tok.json")
    fails(capsys, ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), *SMALL_ARGS,
                   f"--data.tokenizer={tmp_path / 'tok.json'}", "--model.vocab_size=300"],
          "512 tokens", "model.vocab_size=300")


def test_train_generate_preprocess_end_to_end(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *SMALL_ARGS]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and "val_bpb" in rows[-1]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and len(out) > len("def f(x):\n")

    # preprocess with the run's tokenizer, then train on the result
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) for i in range(40)))
    prefix = tmp_path / "docs"
    assert main(["preprocess", "--input", str(jsonl), "--output-prefix", str(prefix),
                 "--tokenizer", str(run_dir / "tokenizer.json"), "--append-eod"]) == 0
    assert (tmp_path / "docs.bin").is_file() and (tmp_path / "docs.idx").is_file()
    assert main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "run2"), *SMALL_ARGS,
                 f"--data.paths={prefix}", f"--data.tokenizer={run_dir / 'tokenizer.json'}"]) == 0


def test_preprocess_malformed_jsonl_names_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    fails(capsys, ["preprocess", "--input", str(bad), "--output-prefix", str(tmp_path / "o"), "--tokenizer",
                   "tiny"], "bad.jsonl", "2")
    assert not list(tmp_path.glob("o.*"))
    fails(capsys, ["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                   str(tmp_path / "o"), "--tokenizer", "tiny"], "missing.jsonl")


def test_convert_bad_sources(capsys, tmp_path):
    fails(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "loom"], "nope")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    fails(capsys, ["convert", str(gpt2), str(tmp_path / "out"), "--to", "loom"], "gpt2")
    assert not (tmp_path / "out").exists()


def test_generate_missing_checkpoint(capsys, tmp_path):
    fails(capsys, ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"], "does not exist")


def test_corrupt_checkpoint_on_resume_keeps_latest(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *SMALL_ARGS]) == 0
    shard = run_dir / "checkpoints" / "step-6" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    fails(capsys, ["train", "--config", "tiny", "--run-dir", str(run_dir), *SMALL_ARGS, "--train.steps=9",
                   "--checkpoint.resume=true"], "__0_0.distcp", "damaged")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-6"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-6"]


def test_the_launcher_starts_workers_without_the_training_stack():
    """`loom train --nproc N` reaches torchrun without importing the trainer (its checkpoint and DTensor imports
    cost every multi-process run ~2 s before the workers start); the run directory it passes on is the default
    runs/NAME-TIME one."""
    import subprocess
    import sys

    from conftest import ROOT

    code = """
import sys
from unittest import mock
import loom.launch
from loom.cli import main
with mock.patch("loom.launch.launch", return_value=0) as launch:
    assert main(["train", "--config", "tiny", "--nproc", "2"]) == 0
run_dir = launch.call_args.args[1][4]
print(run_dir, "loom.train.trainer" in sys.modules, "torch.distributed.checkpoint" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir, trainer, dcp = proc.stdout.split()
    assert run_dir.startswith("runs/tiny-") and (trainer, dcp) == ("False", "False")


def test_fast_exit_keeps_the_code_runs_exit_handlers_and_waits_for_a_running_thread(tmp_path):
    """`python -m loom.cli` and the `loom` script leave through `cli._exit`, which skips the interpreter's
    teardown of torch: the exit code is kept, buffered output (Python's and C's) still reaches the pipe,
    atexit handlers (logging, multiprocessing, inductor's workers) still run, and teardown (a module-level
    object's finaliser) is skipped. It keeps the ordinary exit while another non-daemon thread runs (and
    waits for it), under a profiler, with LOOM_ORDINARY_EXIT=1, and with stdout closed it keeps the code."""
    import os
    import subprocess
    import sys

    script = """
import atexit, ctypes, os, sys, threading, time
from pathlib import Path
from loom.cli import _exit
out, mode, code = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
atexit.register(lambda: (out / "handler").write_text("ran"))
class Teardown:
    def __del__(self, _open=open, _path=str(out / "teardown")):
        with _open(_path, "w") as f:
            f.write("ran")
kept = Teardown()
if mode == "thread":
    def late():
        time.sleep(0.5)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()
if mode == "profiled":
    sys.setprofile(lambda *args: None)
if sys.stdout is not None:
    print("printed", end="")  # no newline, and stdout is a pipe: left in the buffer unless the exit flushes it
    ctypes.CDLL(None).printf(b"from C\\n")  # C's stdio buffer, which os._exit alone would drop
_exit(code)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    cases = [("plain", 0, True), ("plain", 2, True), ("thread", 0, False), ("profiled", 0, False),
             ("ordinary", 0, False), ("closed", 2, True)]
    for mode, code, fast in cases:
        out = tmp_path / f"{mode}{code}"
        out.mkdir()
        run_env = dict(env, LOOM_ORDINARY_EXIT="1") if mode == "ordinary" else env
        close_stdout = (lambda: os.close(1)) if mode == "closed" else None
        proc = subprocess.run([sys.executable, "-c", script, str(out), mode, str(code)], capture_output=close_stdout is None,
                              text=True, env=run_env, preexec_fn=close_stdout)
        assert proc.returncode == code, (mode, code, proc.stderr)
        if mode != "closed":
            assert "printed" in proc.stdout and "from C" in proc.stdout, (mode, proc.stdout)
        assert (out / "handler").read_text() == "ran"
        if mode == "thread":
            assert (out / "thread").read_text() == "done"
        assert (out / "teardown").exists() == (not fast), mode
