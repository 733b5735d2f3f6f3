"""Data as it comes (loom/data/records.py): Parquet files and globs read like JSON lines by `loom preprocess`,
sft.data, pref.data and rl.prompts, with configurable columns; malformed rows counted and named by file and
row; an empty result refused."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loom.cli import main
from loom.data.indexed import IndexedDataset
from loom.errors import UserError

TEXTS = ["the quick brown fox", "jumps over\nthe lazy dog", "", "unicode: naïve café ✓", "x" * 300, "last one"]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
     {"role": "assistant", "content": "Bye!"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
]


@pytest.fixture(autouse=True)
def _no_whole_file_reads(monkeypatch):
    """Parquet is streamed by record batches: reading a whole file or table at once fails these tests."""
    def refuse(*a, **k):
        raise AssertionError("a whole Parquet file was read at once")

    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)


@pytest.fixture(scope="module")
def tok():
    from loom.data.tokenizer import get_tokenizer

    return get_tokenizer("bpe", 512, 300000)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows, row_group_size=2, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return path


def test_preprocess_parquet_glob_equals_jsonl(tok, tmp_path):
    from loom.data.preprocess import preprocess

    rows = [{"body": t, "id": i} for i, t in enumerate(TEXTS)]
    write_jsonl(tmp_path / "all.jsonl", [{"body": r["body"]} for r in rows])
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "part-0.parquet", rows[:4])  # row groups of 2 rows
    write_parquet(tmp_path / "pq" / "part-1.parquet", rows[4:])
    a = preprocess(str(tmp_path / "all.jsonl"), str(tmp_path / "a"), tok, json_key="body", append_eod=True,
                   progress=False)
    b = preprocess(str(tmp_path / "pq" / "part-*.parquet"), str(tmp_path / "b"), tok, json_key="body",
                   append_eod=True, progress=False)
    assert a == {**b, "files": 1} and b["files"] == 2 and a["documents"] == len(TEXTS)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    ds = IndexedDataset(tmp_path / "b")
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eod_id] for t in TEXTS]
    # The CLI: --column names the Parquet column; a missing one is named with the file's columns.
    assert main(["preprocess", "--input", str(tmp_path / "pq"), "--output-prefix", str(tmp_path / "c"),
                 "--tokenizer", str(tok.path), "--column", "body", "--append-eod"]) == 0
    assert (tmp_path / "c.bin").read_bytes() == (tmp_path / "a.bin").read_bytes()
    with pytest.raises(UserError, match=r"part-0\.parquet has no column 'text' \(its columns: body, id\); choose"):
        preprocess(str(tmp_path / "pq"), str(tmp_path / "d"), tok, progress=False)


def test_malformed_rows_are_counted_and_named(tok, tmp_path):
    from loom.data.preprocess import preprocess

    rows = [{"text": "fine"}] * 3 + [{"text": None}] + [{"text": "ok"}] * 2 + [{"text": None}] * 6
    write_parquet(tmp_path / "a.parquet", rows, row_group_size=4, schema=pa.schema([("text", pa.string())]))
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{not json\n{"text": 5}\n')
    with pytest.raises(UserError) as e:
        preprocess(str(tmp_path / "*"), str(tmp_path / "out" / "x"), tok, progress=False)
    msg = str(e.value)
    assert msg.startswith("9 malformed records in 2 files (nothing was used): ")
    assert f"{tmp_path / 'a.parquet'}, row 3: 'text' must be a string, got null" in msg
    assert f"{tmp_path / 'a.parquet'}, row 6: " in msg and "; and 4 more" in msg  # the first five named
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written
    # The same in SFT records: a null, a wrong type and a bad message, each named by file and row.
    chats = [{"messages": CHATS[0]}, {"messages": None}, {"messages": [{"role": "robot", "content": "x"}]}]
    write_parquet(tmp_path / "chat.parquet", chats)
    from loom.post.chat import load_template
    from loom.post.sft_data import prepare

    with pytest.raises(UserError, match=r"2 malformed SFT records in 1 file .*chat\.parquet, row 1: \"messages\" must "
                       r"be a non-empty list.*chat\.parquet, row 2: messages\[0\]"):
        prepare([str(tmp_path / "chat.parquet")], tok, load_template("chatml"))


def test_empty_input_exits_2(tok, tmp_path, capsys):
    write_parquet(tmp_path / "empty.parquet", [], schema=pa.schema([("text", pa.string())]))
    assert main(["preprocess", "--input", str(tmp_path / "empty.parquet"), "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer", str(tok.path)]) == 2
    assert "no non-empty document" in capsys.readouterr().err and not list(tmp_path.glob("o.*"))
    assert main(["preprocess", "--input", str(tmp_path / "none-*.parquet"), "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer", str(tok.path)]) == 2
    assert "matches no file" in capsys.readouterr().err
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    write_parquet(tmp_path / "chat.parquet", [], schema=schema)
    from loom.post.chat import load_template
    from loom.post.sft_data import prepare

    with pytest.raises(UserError, match="no records"):
        prepare([str(tmp_path / "chat.parquet")], tok, load_template("chatml"))


def _examples(prefixes):
    from loom.post.sft_data import Examples

    ex = Examples(prefixes)
    return [tuple(a.tolist() for a in ex.get(i, int(ex.sizes[i]))) for i in range(len(ex))]


def test_sft_parquet_chat_and_renamed_columns_equal_jsonl(tok, tmp_path):
    from loom.config import load_config
    from loom.post.chat import load_template
    from loom.post.sft_data import columns_of, prepare

    template = load_template("chatml")
    records = [{"messages": c} for c in CHATS] + [{"prompt": "1+1=", "completion": "2"}]
    ref = _examples(prepare([str(write_jsonl(tmp_path / "ref.jsonl", records))], tok, template))
    # Parquet: a chat column (list of structs role/content) and a prompt/completion file, under other names.
    write_parquet(tmp_path / "chat.parquet", [{"conv": c, "n": i} for i, c in enumerate(CHATS)])
    write_parquet(tmp_path / "plain.parquet", [{"q": "1+1=", "a": "2"}])
    cfg = load_config("tiny-sft", ["sft.messages_column=conv", "sft.prompt_column=q", "sft.completion_column=a"])
    got = _examples(prepare([str(tmp_path / "*.parquet")], tok, template, columns_of(cfg.sft)))
    assert got == ref and len(ref) == 4 and all(sum(m) > 0 for _, m in ref)
    # loom preprocess --sft takes the same renamed columns
    assert main(["preprocess", "--sft", "--input", str(tmp_path / "*.parquet"),
                 "--output-prefix", str(tmp_path / "pre"), "--tokenizer", str(tok.path), "--template", "chatml",
                 "--messages-column", "conv", "--prompt-column", "q", "--completion-column", "a"]) == 0
    assert _examples([str(tmp_path / "pre")]) == ref


def test_pref_and_rl_read_parquet_with_their_columns(tok, tmp_path):
    from loom.config import load_config
    from loom.post.chat import load_template
    from loom.post.pref_data import Pairs, pair_columns, prepare_pairs
    from loom.post.rl.prompts import PromptSet

    template = load_template("chatml")
    plain = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    chat = {"prompt": [{"role": "user", "content": "Capital of France?"}],
            "chosen": [{"role": "assistant", "content": "Paris."}],
            "rejected": [{"role": "assistant", "content": "Lyon."}]}
    ref = prepare_pairs([str(write_jsonl(tmp_path / "pairs.jsonl", [plain, chat]))], tok, template)
    # Parquet rows are column-typed: plain pairs in one file, chat pairs (lists of structs) in another.
    write_parquet(tmp_path / "pairs-0.parquet", [{"question": "2+2=", "good": "4", "bad": "5"}])
    write_parquet(tmp_path / "pairs-1.parquet", [{"question": chat["prompt"], "good": chat["chosen"],
                                                  "bad": chat["rejected"]}])
    cfg = load_config("tiny-dpo", ["pref.prompt_column=question", "pref.chosen_column=good",
                                   "pref.rejected_column=bad"])
    got = prepare_pairs([str(tmp_path / "pairs-*.parquet")], tok, template, pair_columns(cfg.pref))
    a, b = Pairs(*ref), Pairs(*got)
    assert len(a) == len(b) == 2
    for i in range(2):
        assert all(np.array_equal(x, y) for s in (0, 1) for x, y in zip(a.get(i, s), b.get(i, s))), i

    prompts = [{"prompt": "12+30=", "answer": "42"}, {"prompt": "1+1=", "answer": "2"}]
    want = PromptSet([str(write_jsonl(tmp_path / "p.jsonl", prompts))], "rl", tok, None, 64, "rl.prompts")
    write_parquet(tmp_path / "p.parquet", [{"question": p["prompt"], "answer": p["answer"]} for p in prompts])
    have = PromptSet([str(tmp_path / "p.parq*")], "rl", tok, None, 64, "rl.prompts", prompt_column="question")
    assert (have.texts, have.ids, have.fields) == (want.texts, want.ids, want.fields)
    assert have.fields == [{"answer": "42"}, {"answer": "2"}]
    with pytest.raises(UserError, match=r"2 malformed prompt records .*p\.parquet, row 0: a prompt record needs"):
        PromptSet([str(tmp_path / "p.parquet")], "rl", tok, None, 64, "rl.prompts")  # no "prompt" column


def test_column_keys_are_checked():
    from loom.config import load_config

    with pytest.raises(UserError, match="must name different columns"):
        load_config("tiny-dpo", ["pref.chosen_column=x", "pref.rejected_column=x"])
    with pytest.raises(UserError, match="sft.prompt_column=' ' must name"):
        load_config("tiny-sft", ["sft.prompt_column= "])
