"""Defects a new user hit with their own data and the CLI: validation scored on training data, token ids
beyond the vocabulary found mid-run, an end-of-document token demanded where none is used, datasets
overwritten under a run, file modes, and the small things (--version, --print-config, help texts)."""

import json
import os
import stat
import tomllib

import numpy as np
import pytest
import tokenizers

from conftest import SMALL, run_cli, run_main, small_config
from loom.cli import main
from loom.config import load_config
from loom.data.indexed import IndexedDatasetBuilder, stats_path
from loom.data.token_datasets import build_datasets
from loom.errors import UserError


def write_docs(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(d)
    return str(prefix)


def doc_ids_of(dataset) -> set[int]:
    """Every document whose (unique) token appears in the dataset's samples."""
    return {int(t) - 1 for i in range(len(dataset)) for t in np.unique(dataset[i])}


def test_validation_on_own_data_is_a_held_out_document_split(tmp_path):
    # 200 documents; document i is 40 copies of token i + 1, so a sample's tokens name its documents.
    prefix = write_docs(tmp_path / "d", [np.full(40, i + 1) for i in range(200)])
    cfg = small_config(f"data.paths={prefix}", "train.steps=30")
    train, val = build_datasets(cfg, None)
    train_docs, val_docs = doc_ids_of(train), doc_ids_of(val)
    assert not train_docs & val_docs  # nothing scored as validation is trained on
    assert val_docs <= set(range(194, 200))  # 969,30,1 of 200: train 0..193, valid 194..199, test 199
    assert len(train_docs) > 150
    assert "data.split=969,30,1" in val.source and "194..199" in val.source
    _, val2 = build_datasets(small_config(f"data.paths={prefix}", "data.split=90,10,0"), None)
    assert doc_ids_of(val2) <= set(range(180, 200)) and len(doc_ids_of(val2)) > 6


def test_data_split_is_validated():
    with pytest.raises(UserError, match="data.split='1,x'"):
        load_config("tiny", ["data.split=1,x"])
    with pytest.raises(UserError, match="positive train share"):
        load_config("tiny", ["data.split=0,5,5"])


def test_token_ids_beyond_the_vocabulary_are_found_before_training(tmp_path):
    docs = [np.arange(1, 41) for _ in range(100)]
    docs[80] = docs[80].copy()
    docs[80][7] = 600  # after document 64: the old check sampled only the first 64 documents
    prefix = write_docs(tmp_path / "d", docs)
    assert json.loads(stats_path(prefix).read_text())["max_token_id"] == 600  # recorded at write time
    cfg = small_config(f"data.paths={prefix}")  # model.vocab_size=512
    with pytest.raises(UserError, match=r"d\.bin: document 80 holds token id 600.*ids 0\.\.511"):
        build_datasets(cfg, None)
    stats_path(prefix).unlink()  # a dataset from an older tool: one numpy pass finds it
    with pytest.raises(UserError, match="document 80 holds token id 600"):
        build_datasets(cfg, None)
    assert main(["train", "--config", "tiny", *[f"--{o}" for o in SMALL], f"--data.paths={prefix}",
                 "--run-dir", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


def _tokenizer_without_eod(path):
    from tokenizers import models, pre_tokenizers

    vocab = {"<pad>": 0, **{chr(c): i + 1 for i, c in enumerate(range(ord("a"), ord("z") + 1))}, " ": 27}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<pad>"])
    tok.save(str(path))
    return path


def test_eod_token_is_required_only_where_it_is_used(tmp_path, capsys):
    tok = _tokenizer_without_eod(tmp_path / "tokenizer.json")
    text = tmp_path / "t.jsonl"
    text.write_text("\n".join(json.dumps({"text": "hello world " * 5}) for _ in range(4)))
    args = ["preprocess", "--input", str(text), "--tokenizer", str(tok)]
    assert main([*args, "--output-prefix", str(tmp_path / "a")]) == 0  # no --append-eod: none needed
    capsys.readouterr()
    assert main([*args, "--output-prefix", str(tmp_path / "b"), "--append-eod"]) == 2
    err = capsys.readouterr().err
    assert "--append-eod needs an end-of-document token" in err and "<pad>" in err and "--eod-token" in err
    assert not (tmp_path / "b.bin").exists()
    assert main([*args, "--output-prefix", str(tmp_path / "c"), "--append-eod", "--eod-token", "<pad>"]) == 0
    from loom.data.indexed import IndexedDataset

    assert IndexedDataset(tmp_path / "c")[0][-1] == 0 and IndexedDataset(tmp_path / "a")[0][-1] != 0


def test_generate_runs_without_eod_and_says_when_the_context_ends(tmp_path):
    from loom.models import build_model
    from loom.models.io import save_model_dir

    tok = _tokenizer_without_eod(tmp_path / "tokenizer.json")
    cfg = load_config("tiny", ["model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=2",
                               "model.ffn_hidden=64", "model.vocab_size=28", "model.max_seq_len=16", "train.seq_len=16"])
    (tmp_path / "m").mkdir()
    save_model_dir(build_model(cfg.model, seed=0), cfg, tmp_path / "m", tokenizer_path=tok)
    proc = run_main("generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "abc", "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert "stopped after 13 new tokens at the model's context length (max_seq_len=16, prompt 3 tokens)" in proc.stderr
    proc = run_main("generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "abc", "--max-new-tokens", "5")
    assert proc.returncode == 0 and "context length" not in proc.stderr


def test_preprocess_refuses_to_overwrite_and_resume_refuses_changed_data(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run), *[f"--{o}" for o in SMALL],
                 "--train.steps=1"]) == 0
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) for i in range(40)))
    prefix = str(tmp_path / "docs")
    pre = ["preprocess", "--input", str(docs), "--output-prefix", prefix, "--tokenizer", str(run / "tokenizer.json"),
           "--append-eod"]
    assert main(pre) == 0
    before = (tmp_path / "docs.bin").read_bytes()
    capsys.readouterr()
    assert main(pre) == 2
    assert "already exist" in capsys.readouterr().err and (tmp_path / "docs.bin").read_bytes() == before

    train = ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r2"), *[f"--{o}" for o in SMALL],
             f"--data.paths={prefix}", f"--data.tokenizer={run / 'tokenizer.json'}", "--checkpoint.interval=2",
             "--train.steps=2"]
    assert main(train) == 0
    docs.write_text("\n".join(json.dumps({"text": f"class C{i}:\n    pass\n" * 9}) for i in range(40)))
    assert main([*pre, "--overwrite"]) == 0
    capsys.readouterr()
    assert main([*train[:-1], "--train.steps=4", "--checkpoint.resume=true"]) == 2
    err = capsys.readouterr().err
    assert "the data changed since checkpoint" in err and prefix in err


def test_version_print_config_and_help_texts(tmp_path):
    from loom import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"loom {__version__}"
    proc = run_main("train", "--config", "tiny", "--train.steps=7", "--parallel.tp=2", "--run-dir",
                    str(tmp_path / "r"), "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    assert printed == load_config("tiny", ["train.steps=7", "parallel.tp=2"]).to_dict()
    assert printed["train"]["steps"] == 7 and not (tmp_path / "r").exists()
    for command, needles in (("generate", ["Continue --prompt", "a run directory (its latest checkpoint)"]),
                             ("convert", ["Convert a model", "the directory to write"]),
                             ("preprocess", ["Refuses to replace an existing dataset", "--overwrite", "--eod-token"])):
        proc = run_main(command, "--help")
        assert proc.returncode == 0 and all(n in " ".join(proc.stdout.split()) for n in needles), (command, proc.stdout)


def test_files_loom_writes_honour_the_umask(tmp_path):
    from loom.models import build_model
    from loom.models.io import save_model_dir
    from loom.train.trainer import Trainer

    old = os.umask(0o022)
    try:
        Trainer(small_config("train.steps=1", "checkpoint.save_final=false"), tmp_path / "r", quiet=True)
        cfg = small_config()
        (tmp_path / "m").mkdir()
        save_model_dir(build_model(cfg.model), cfg, tmp_path / "m", tokenizer_path=tmp_path / "r" / "tokenizer.json")
    finally:
        os.umask(old)
    for path in (tmp_path / "r" / "tokenizer.json", tmp_path / "m" / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
