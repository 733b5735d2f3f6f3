"""Weights & Biases tracking (`log.wandb`): an offline run read back from its own .wandb file, resumed into the
same W&B run; and wandb never imported unless asked for."""

import json
import shutil
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SMALL
from loom.cli import main

ARGS = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL]]


def wandb_records(path):
    """The records of a .wandb file: W&B's log format (LevelDB's: 32 KiB blocks, each record in chunks with a
    7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) after a 7-byte file header
    (":W&B", magic, version), decoded as wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def read_run(run_dir):
    """{run_id, name, tags, config, history: {step: {key: value}}} of the offline run under `run_dir`."""
    files = list(run_dir.glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    for _ in range(100):  # wandb's service may still be writing the file's end after finish() returned
        records = wandb_records(files[0])
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    run = {"history": {}, "config": {}}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.update(run_id=r.run.run_id, name=r.run.display_name, tags=list(r.run.tags))
            run["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            run["history"].setdefault(r.history.step.num, {}).update(items)
    return run


def test_loom_never_imports_wandb_unless_asked(tmp_path, monkeypatch, capsys):
    """First in this file: in `make test`'s one process nothing has imported wandb yet, so the check runs
    here; where something has, it runs in a fresh interpreter."""
    args = [*ARGS, "--run-dir", str(tmp_path / "run"), "--train.steps=1", "--train.eval_interval=0"]
    if "wandb" in sys.modules:
        code = (f"import sys, loom\nfrom loom.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n"
                f"    pass\nassert main({args!r}) == 0\nassert 'wandb' not in sys.modules\nprint('ok')")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True)
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    else:
        with pytest.raises(SystemExit):
            main(["--version"])
        assert main(args) == 0
        assert "wandb" not in sys.modules, "a run without log.wandb imported wandb"
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: refused before the run starts
    capsys.readouterr()
    assert main([*ARGS, "--run-dir", str(tmp_path / "run2"), "--log.wandb=true"]) == 2
    assert 'pip install "loom[wandb]"' in capsys.readouterr().err
    assert not (tmp_path / "run2").exists()


def test_offline_run_holds_every_metric_and_the_config_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")  # log.wandb_mode=auto honours it
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "my-run"
    args = [*ARGS, "--run-dir", str(run_dir), "--train.steps=3", "--train.eval_interval=2", "--train.eval_samples=4",
            "--checkpoint.interval=2", "--log.wandb=true", "--log.wandb_tags=tiny,test"]
    assert main(args) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {1, 2, 3} and any("val_loss" in r for r in rows)
    first = read_run(wandb_dir / "wandb")
    rid = (run_dir / "wandb_id").read_text().strip()
    assert first["run_id"] == rid and first["name"] == "my-run" and first["tags"] == ["tiny", "test"]
    for row in rows:  # every key of every metrics.jsonl row, at its step, with the same value
        logged = first["history"][row["step"]]
        for key, value in row.items():
            if key != "step" and value is not None:
                assert logged[key] == value, (row["step"], key, logged.get(key), value)
    from loom.config import load_config

    config = load_config("tiny", [a[2:] for a in args[3:] if a.startswith("--") and "=" in a]).to_dict()
    for section, table in json.loads(json.dumps(config)).items():
        assert first["config"][section] == table, section
    assert first["config"]["log"]["wandb"] is True and first["config"]["train"]["steps"] == 3

    # Resume from the step-2 checkpoint: the same W&B run id, its rows from step 3 on.
    shutil.rmtree(run_dir / "checkpoints" / "step-3")
    (run_dir / "checkpoints" / "latest").write_text("step-2\n")
    for p in (wandb_dir / "wandb").glob("offline-run-*"):
        shutil.move(p, tmp_path / p.name)
    assert main([*args, "--checkpoint.resume=true"]) == 0
    second = read_run(wandb_dir / "wandb")
    assert second["run_id"] == rid and (run_dir / "wandb_id").read_text().strip() == rid
    step3 = [r for r in rows if r["step"] == 3 and "loss" in r][0]
    assert min(second["history"]) == 3 and second["history"][3]["loss"] == step3["loss"], second["history"]


def test_run_id_is_kept_for_resumes_only(tmp_path):
    from loom.train.tracking import run_id

    ids = iter(["a1", "b2"])
    assert run_id(tmp_path, False, lambda: next(ids)) == "a1"
    assert run_id(tmp_path, True, lambda: next(ids)) == "a1"  # resumed: the stored id
    assert run_id(tmp_path, False, lambda: next(ids)) == "b2"  # a fresh run: a new one, stored
    assert (tmp_path / "wandb_id").read_text().strip() == "b2"
