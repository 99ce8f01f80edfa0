"""Reading PATH: text files, .jsonl, directories of .txt, saved datasets; bad input is one line."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from normswap import data as nsdata
from normswap.data import open_corpus
from normswap.errors import NormswapError

DATA = Path(__file__).parent / "data"


def texts(corpus) -> list[str]:
    return ["".join(doc) for doc in corpus.documents()]


def test_plain_text_file_is_one_document(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first line\nsecond line\n")
    c = open_corpus(p)
    assert c.kind == "text" and texts(c) == ["first line\nsecond line\n"]
    assert texts(open_corpus(DATA / "lighthouse.txt")) == [(DATA / "lighthouse.txt").read_text()]


def test_large_text_is_cut_only_at_safe_line_breaks(tmp_path, monkeypatch):
    monkeypatch.setattr(nsdata, "FIRST_PIECE_CHARS", 100)
    monkeypatch.setattr(nsdata, "MAX_PIECE_CHARS", 400)
    lines = [f"Line {i} says something{'.' if i % 3 else ''}\n" for i in range(200)]
    lines[50:53] = ["\n", "   indented\n", "\n"]
    text = "".join(lines)
    p = tmp_path / "big.txt"
    p.write_text(text)
    (doc,) = list(open_corpus(p).documents())
    pieces = list(doc)
    assert len(pieces) > 5 and "".join(pieces) == text
    for before, after in zip(pieces[:-1], pieces[1:], strict=True):
        assert before.endswith("\n") and not before[-2].isspace() and not after[0].isspace()
    assert max(map(len, pieces)) < 400 + 40  # the cap plus one line


def test_jsonl_rows_with_a_text_field(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"text": "one", "id": 1}, {"text": "two"}]) + "\n\n")
    assert texts(open_corpus(p)) == ["one", "two"]
    q = tmp_path / "body.jsonl"
    q.write_text(json.dumps({"body": "three"}) + "\n")
    assert texts(open_corpus(q, text_field="body")) == ["three"]
    with pytest.raises(NormswapError, match=r"body.jsonl:1: no field 'text' \(fields: body\); pick one with text_field=FIELD$"):
        texts(open_corpus(q))


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": 3}', "field 'text' is int, not text"),
])
def test_bad_jsonl_rows_name_the_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(NormswapError, match=f"bad.jsonl:2: {message}"):
        texts(open_corpus(p))


def test_directory_of_txt_files_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")
    (tmp_path / "notes.md").write_text("not read")
    c = open_corpus(tmp_path)
    assert c.kind == "txt-dir" and texts(c) == ["ay", "bee", "sea"]


@pytest.mark.parametrize("content,message", [
    (b"", "empty file"),
    (b"  \n\n\t\n", "empty file"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00binary", "a binary file"),
    (b"caf\xe9 latin-1 text", "not UTF-8 text"),
])
def test_empty_and_binary_files_are_refused(tmp_path, content, message):
    p = tmp_path / "data.txt"
    p.write_bytes(content)
    with pytest.raises(NormswapError, match=message):
        open_corpus(p)


def test_invalid_utf8_further_in_is_an_error_when_read(tmp_path):
    p = tmp_path / "late.txt"
    p.write_bytes(b"fine text\n" * 2000 + b"\xff\xfe broken\n")
    c = open_corpus(p)  # the first 8 KB are fine
    with pytest.raises(NormswapError, match="not UTF-8 text further in"):
        texts(c)


def test_missing_paths_and_empty_directories(tmp_path):
    with pytest.raises(NormswapError, match="no such file or directory"):
        open_corpus(tmp_path / "nope.txt")
    with pytest.raises(NormswapError, match="no .txt files"):
        open_corpus(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(NormswapError, match="every .txt file in it is empty"):
        open_corpus(tmp_path)


def test_a_saved_dataset_without_the_datasets_package_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "dataset_info.json").write_text("{}")
    (tmp_path / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(NormswapError, match=r"needs the datasets package \(pip install datasets\)"):
        open_corpus(tmp_path)


def fake_datasets(saved: dict[str, object]) -> types.ModuleType:
    """A stand-in for the `datasets` package: load_from_disk returns what was 'saved' at a path.
    (datasets is not installed here; the real one returns a Dataset or a DatasetDict, a dict.)"""
    module = types.ModuleType("datasets")
    module.load_from_disk = lambda path: saved[path]
    return module


def test_a_saved_dataset_is_read_row_by_row(tmp_path, monkeypatch):
    (tmp_path / "dataset_info.json").write_text("{}")
    rows = [{"text": "alpha", "label": 0}, {"text": "beta", "label": 1}]
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({str(tmp_path): rows}))
    c = open_corpus(tmp_path)
    assert c.kind == "dataset" and texts(c) == ["alpha", "beta"]


def test_a_saved_dataset_dict_scores_its_test_split(tmp_path, monkeypatch):
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    saved = {"train": [{"text": "train row"}], "test": [{"content": "test row"}]}
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets({str(tmp_path): saved}))
    assert texts(open_corpus(tmp_path, text_field="content")) == ["test row"]
    saved.clear()
    saved.update(a=[], b=[])
    with pytest.raises(NormswapError, match="splits a, b and none named test/validation/train"):
        texts(open_corpus(tmp_path))


@pytest.mark.skipif(__import__("importlib").util.find_spec("datasets") is None,
                    reason="the datasets package is not installed here (a fake stands in above)")
def test_a_real_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["one", "two"]}).save_to_disk(str(tmp_path / "ds"))
    assert texts(open_corpus(tmp_path / "ds")) == ["one", "two"]


@pytest.mark.slow
def test_pieces_tokenise_exactly_like_the_whole_text_for_smollm2(tmp_path, monkeypatch):
    """The cut rule holds for a real byte-level BPE tokenizer: encoding the pieces of a file one
    by one gives the tokens of the whole file."""
    from normswap.evaluate import _cuts_are_exact, document_tokens
    from normswap.loading import DEFAULT_MODEL, load_tokenizer, resolve

    tok = load_tokenizer(resolve(DEFAULT_MODEL))
    assert _cuts_are_exact(tok)
    monkeypatch.setattr(nsdata, "FIRST_PIECE_CHARS", 500)
    text = (Path(nsdata.__file__).parent / "data" / "genesis-kjv.txt").read_text()
    p = tmp_path / "g.txt"
    p.write_text(text)
    (doc,) = list(open_corpus(p).documents())
    assert len(list(doc)) > 3
    streamed = [t for chunk in document_tokens(tok, open_corpus(p).documents()) for t in chunk]
    assert streamed == tok(text, add_special_tokens=False)["input_ids"]


def test_gzip_text_reads_like_the_plain_file(tmp_path):
    import gzip

    text = "In the beginning God created the heaven and the earth.\n" * 2000
    plain, packed = tmp_path / "a.txt", tmp_path / "a.txt.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    read = ["".join(doc) for doc in open_corpus(packed).documents()]
    assert read == ["".join(doc) for doc in open_corpus(plain).documents()] == [text]


def test_a_byte_order_mark_is_not_read_as_text(tmp_path):
    import gzip

    bom = "\ufeff".encode()
    (tmp_path / "a.txt").write_bytes(bom + b"In the beginning\n")
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(bom + b"In the beginning\n"))
    (tmp_path / "rows.jsonl").write_bytes(bom + (json.dumps({"text": "one"}) + "\n").encode())
    assert texts(open_corpus(tmp_path / "a.txt")) == texts(open_corpus(tmp_path / "a.txt.gz")) == ["In the beginning\n"]
    assert texts(open_corpus(tmp_path / "rows.jsonl")) == ["one"]  # was "not valid JSON" at line 1
    # only a leading mark is one: a U+FEFF inside the text is a character of it
    (tmp_path / "b.txt").write_bytes(b"x" + bom)
    assert texts(open_corpus(tmp_path / "b.txt")) == ["x\ufeff"]


def test_gzip_that_is_not_gzip_is_one_clear_error(tmp_path):
    bad = tmp_path / "b.txt.gz"
    bad.write_text("plain text with a .gz name\n")
    with pytest.raises(NormswapError, match="not a valid gzip file"):
        open_corpus(bad)


@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_data_path_is_bad_input_not_the_current_directory(tmp_path, monkeypatch, path):
    """`normswap ppl MODEL --data "$TEXT"` with TEXT unset scored every .txt file in the current
    directory and reported a perplexity 'on ' (Path("") is "."): a number for data never chosen."""
    from normswap.errors import BadInputError

    (tmp_path / "notes.txt").write_text("some text in the current directory")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError, match="the data path is empty"):
        open_corpus(path)


def test_gzip_jsonl_is_read_by_rows_like_the_plain_file(tmp_path):
    """rows.jsonl.gz (how large corpora ship) was read as plain text, its JSON syntax ('{"text": ')
    scored as if it were the document, with no complaint: the kind came from the last suffix (.gz)."""
    import gzip

    rows = "\n".join(json.dumps(r) for r in [{"text": "one", "id": 1}, {"text": "two"}]) + "\n"
    (tmp_path / "rows.jsonl").write_text(rows)
    (tmp_path / "rows.JSONL.gz").write_bytes(gzip.compress(rows.encode()))
    packed = open_corpus(tmp_path / "rows.JSONL.gz")
    assert packed.kind == "jsonl" and texts(packed) == texts(open_corpus(tmp_path / "rows.jsonl")) == ["one", "two"]
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{not json}\n'))
    with pytest.raises(NormswapError, match="bad.jsonl.gz:2: not valid JSON"):
        texts(open_corpus(tmp_path / "bad.jsonl.gz"))
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress(rows.encode()))  # any other .gz: text, as before
    assert open_corpus(tmp_path / "notes.txt.gz").kind == "text"
