"""normswap.jsonsafe.loads / read: the one reader of user JSON files. Whatever the input, it
returns what json.loads returns or raises a ValueError with a one-line reason; never a
RecursionError (json's nesting limit) or a codec message. read_or_refuse: the same failures as one
bad-input line naming the file and the reason."""

from __future__ import annotations

import json
import random

import pytest

from normswap import jsonsafe


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(7 if depth < 6 else 4)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-10**12, 10**12)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind == 3:
        return "".join(rng.choice("aé€😀\"\\\n\t{[") for _ in range(rng.randrange(8)))
    if kind in (4, 5):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}{rng.choice('é😀')}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(5))
def test_valid_json_reads_as_json_loads_reads_it(seed):
    rng = random.Random(seed)
    for _ in range(40):
        value = _random_value(rng, 0)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert jsonsafe.loads(text) == json.loads(text)
        assert jsonsafe.loads(text.encode()) == json.loads(text)


def test_nesting_up_to_the_limit_reads_and_past_it_is_refused():
    n = jsonsafe.MAX_DEPTH
    assert jsonsafe.loads("[" * n + "]" * n) == json.loads("[" * n + "]" * n)
    assert jsonsafe.loads('{"a":' * n + "1" + "}" * n) is not None
    # Brackets inside strings are not nesting: many of them stay readable.
    assert jsonsafe.loads(json.dumps(["[{" * 500])) == ["[{" * 500]
    for text in ("[" * (n + 1) + "]" * (n + 1), '{"a":' * (n + 1) + "1" + "}" * (n + 1),
                 "[" * 900 + "]" * 900,  # parses in json, but deep enough to exhaust the stack later
                 "[" * 100_000 + "]" * 100_000,  # json itself: RecursionError
                 "[" * 100_000):  # and unclosed
        for data in (text, text.encode()):
            with pytest.raises(ValueError, match=r"^nested too deeply: more than 100 levels$"):
                jsonsafe.loads(data)


@pytest.mark.parametrize("data, offset", [
    (b'{"name": "caf\xe9"}', 13),  # a Latin-1 editor's save
    (b"\xff\xfe{\x00}\x00", 0),  # UTF-16 with its byte order mark
    (b'["\xed\xa0\x80"]', 2),  # an encoded surrogate is not UTF-8
    (b"[1, 2]\x80", 6),
])
def test_bytes_that_are_not_utf8_name_the_offset(data, offset):
    with pytest.raises(ValueError, match=rf"^not UTF-8: invalid byte at offset {offset}$"):
        jsonsafe.loads(data)


@pytest.mark.parametrize("data", ["", "   ", '{"a": 1,', "{'a': 1}", "[1, 2] [3]", "nul", "\ufeff{}",
                                  '{"a": "line\nbreak"}', "1" * 5000])
def test_text_that_is_not_json_is_one_line_valueerror(data):
    with pytest.raises(ValueError) as e:
        jsonsafe.loads(data)
    assert type(e.value) is ValueError and str(e.value) and "\n" not in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_random_bytes_give_a_value_or_a_valueerror():
    rng = random.Random(0)
    alphabet = b'[]{}",:0123456789 -.eEtrufalsn\\\xc3\xa9\xff'
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        try:
            jsonsafe.loads(data)
        except ValueError as e:
            assert type(e) is ValueError and "\n" not in str(e)


def test_read_reads_a_file_and_leaves_oserror_to_the_caller(tmp_path):
    p = tmp_path / "x.json"
    p.write_bytes(b'{"a": [1, "\xc3\xa9"]}')
    assert jsonsafe.read(p) == {"a": [1, "é"]}
    p.write_bytes(b"[" * 5000)
    with pytest.raises(ValueError, match="nested too deeply"):
        jsonsafe.read(p)
    with pytest.raises(FileNotFoundError):
        jsonsafe.read(tmp_path / "missing.json")
    with pytest.raises(IsADirectoryError):
        jsonsafe.read(tmp_path)


def test_read_or_refuse_names_the_file_its_role_and_the_reason_on_one_line(tmp_path):
    from normswap.errors import NormswapError

    p = tmp_path / "config.json"
    p.write_text('{"hidden_size": 8, "eps": [0.5]}')
    assert jsonsafe.read_or_refuse(p, what="config.json") == {"hidden_size": 8, "eps": [0.5]}
    p.write_text('{"model_type": "llama",')
    with pytest.raises(NormswapError) as e:
        jsonsafe.read_or_refuse(p, what="config.json")
    assert str(e.value) == (f"{p}: malformed config.json (Expecting property name enclosed in double quotes: "
                            "line 1 column 24 (char 23))")
    with pytest.raises(NormswapError) as e:
        jsonsafe.read_or_refuse(p, "delete it to start again")
    assert str(e.value).startswith(f"{p}: malformed JSON (Expecting") and str(e.value).endswith(
        "; delete it to start again")
    with pytest.raises(NormswapError) as e:
        jsonsafe.read_or_refuse(tmp_path / "missing.json", what="config.json")
    assert str(e.value) == f"{tmp_path / 'missing.json'}: cannot read (No such file or directory)"
    with pytest.raises(NormswapError) as e:
        jsonsafe.read_or_refuse(tmp_path, "choose another")
    assert str(e.value) == f"{tmp_path}: cannot read (Is a directory); choose another"
