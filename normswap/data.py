"""Reading evaluation text from PATH: a plain text file (or a gzip-compressed `.gz` one), a .jsonl file (or .jsonl.gz) with a text field, a directory
of .txt files, or a `datasets` dataset saved to disk (`save_to_disk`).

`open_corpus` checks what it can up front (the path exists, is not empty, is not binary, the
`datasets` package is there when needed) so that bad input fails before a model is loaded; the
text itself is read lazily, document by document, so memory does not grow with the corpus.

A document is yielded as an iterator of text pieces, never longer than MAX_PIECE_CHARS, whatever
the file's shape: a 50 MB file on one line (text8) is read in blocks and cut like any other
(`cut_pieces`). A cut goes, by preference, at a line break that follows a non-blank character and
precedes a non-blank line; in a long line, before a space between two non-blank characters; only
a run of MAX_PIECE_CHARS / 2 characters with neither is cut anywhere. For byte-level BPE tokenizers
(GPT-2, Llama 3, SmolLM2, Qwen) encoding the pieces one by one gives exactly the tokens of the whole
text, because their pre-tokenizers always split there (a space starts the next word's token). The
evaluator checks that property on the tokenizer at hand; where it does not hold (SentencePiece's
prefix space) it joins pieces up to MAX_PIECE_CHARS, so such a tokenizer sees one cut per million
characters (one token in ~250k may differ from encoding the whole text) and memory stays bounded.
"""

from __future__ import annotations

import codecs
import gzip
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from normswap import jsonsafe
from normswap.errors import BadInputError, Metavar, NormswapError, way_out

# Piece sizes for large plain files: small first (a --max-tokens run tokenises little), growing to
# a cap that keeps the tokenizer's working set bounded.
FIRST_PIECE_CHARS = 64 * 1024
MAX_PIECE_CHARS = 1024 * 1024
_READ_CHARS = 64 * 1024  # plain files are read in blocks: a line may be the whole file
_LINE_CUT = re.compile(r"(?<=\S\n)(?=\S)")  # after "x\n", before a non-blank line
_SPACE_CUT = re.compile(r"(?<=\S)(?= \S)")  # before the space that starts the next word
_SNIFF_BYTES = 8192
# Files that mark a directory written by datasets' save_to_disk.
_DATASET_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")
# With a DatasetDict, the split scored when the user did not name one: held-out text first.
_SPLIT_PREFERENCE = ("test", "validation", "train")

Document = Iterator[str]


@dataclass(frozen=True)
class Corpus:
    """A validated PATH and how to read it; `documents()` may be called more than once."""

    path: Path
    kind: str  # "text", "jsonl", "txt-dir" or "dataset"
    text_field: str = "text"

    def documents(self) -> Iterator[Document]:
        if self.kind == "text":
            yield _text_file_pieces(self.path)
        elif self.kind == "txt-dir":
            for f in _txt_files(self.path):
                yield _text_file_pieces(f)
        elif self.kind == "jsonl":
            yield from _jsonl_documents(self.path, self.text_field)
        else:
            yield from _dataset_documents(self.path, self.text_field)


def open_corpus(path: str | Path, text_field: str = "text") -> Corpus:
    """Validate PATH and say how to read it; raise a one-line NormswapError on bad input."""
    if not str(path).strip():  # Path("") is the current directory: an unset "$TEXT" would name it
        raise BadInputError("the data path is empty; pass a text file, a .jsonl, a directory of .txt files "
                            "or a saved dataset")
    p = Path(path).expanduser()
    if not p.exists():
        raise NormswapError(f"{path}: no such file or directory")
    if p.is_dir():
        if any((p / m).is_file() for m in _DATASET_MARKERS):
            _require_datasets(p)
            return Corpus(p, "dataset", text_field)
        files = _txt_files(p)
        if not files:
            raise NormswapError(f"{path}: a directory with no .txt files (and not a saved `datasets` dataset)")
        for f in files:
            _sniff_text(f, allow_empty=True)
        if all(f.stat().st_size == 0 for f in files):
            raise NormswapError(f"{path}: every .txt file in it is empty")
        return Corpus(p, "txt-dir", text_field)
    if not p.is_file():
        raise NormswapError(f"{path}: not a regular file")
    _sniff_text(p, allow_empty=False)
    # rows.jsonl.gz is rows too: read as text, its JSON syntax was scored as the document
    if (Path(p.stem) if _is_gzip(p) else p).suffix.lower() == ".jsonl":
        return Corpus(p, "jsonl", text_field)
    return Corpus(p, "text", text_field)


def _txt_files(directory: Path) -> list[Path]:
    # Sorted, so that the corpus (and so the perplexity) does not depend on directory order.
    return sorted(
        f for f in directory.rglob("*.txt")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(directory).parts)
    )


def _sniff_text(path: Path, allow_empty: bool) -> None:
    """Refuse empty files and files that are not UTF-8 text, from their first few KB."""
    try:
        with _open_bytes(path) as fh:
            head = fh.read(_SNIFF_BYTES)
    except (OSError, EOFError) as e:  # gzip raises BadGzipFile (an OSError) or EOFError
        if isinstance(e, (gzip.BadGzipFile, EOFError)):
            raise NormswapError(f"{path}: not a valid gzip file ({e})") from None
        raise NormswapError(f"{path}: cannot read ({e.strerror or e})") from None
    if not head.strip():
        if allow_empty:
            return
        if len(head) < _SNIFF_BYTES:  # the whole (decompressed) file was read: all blank
            raise NormswapError(f"{path}: empty file (no text to score)")
    if b"\x00" in head:
        raise NormswapError(f"{path}: a binary file, not text (NUL bytes in its first {len(head)} bytes)")
    try:
        # final=False: a multi-byte character cut at the sniff boundary is not an error.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise NormswapError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def _is_gzip(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def _open_text(path: Path):
    # Compressed text (e.g. the King James books the recipes ship) is read through gzip, lazily.
    # utf-8-sig: a byte-order mark (Windows editors write one) is not text; read as "utf-8" it was
    # scored as a token of the document and made a .jsonl's first row invalid JSON.
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8-sig", errors="strict", newline="")
    return open(path, encoding="utf-8-sig", errors="strict", newline="")


def _decode_error(path: Path, e: UnicodeDecodeError) -> NormswapError:
    return NormswapError(f"{path}: not UTF-8 text further in ({e.reason})")


def _text_file_pieces(path: Path) -> Document:
    """The file's text in bounded pieces cut at token-safe places (see the module docstring)."""
    try:
        with _open_text(path) as fh:
            yield from cut_pieces(iter(lambda: fh.read(_READ_CHARS), ""))
    except UnicodeDecodeError as e:
        raise _decode_error(path, e) from None


def cut_pieces(stream: Iterable[str], first: int | None = None, cap: int | None = None) -> Iterator[str]:
    """Re-cut a stream of text (any sizes, cut anywhere) into pieces of at most `first` characters,
    the limit doubling up to `cap` (small first: a --max-tokens run tokenises little), each cut at
    the last safe place in the second half of the limit (see the module docstring)."""
    limit = first or FIRST_PIECE_CHARS
    cap = cap or MAX_PIECE_CHARS
    buf, start = "", 0
    for block in stream:
        buf, start = buf[start:] + block, 0
        while len(buf) - start > limit:
            cut = _last_cut(buf, start + limit // 2, start + limit)
            yield buf[start:cut]
            start = cut
            limit = min(2 * limit, cap)
    if start < len(buf):
        yield buf[start:]


def _last_cut(text: str, lo: int, hi: int) -> int:
    """The last safe cut position in text[lo:hi] (a line break first, then a space), else hi."""
    for pattern in (_LINE_CUT, _SPACE_CUT):
        last = None
        for last in pattern.finditer(text, lo, hi + 1):  # noqa: B007 - the last match is wanted
            pass
        if last is not None and last.start() > lo:
            return last.start()
    return hi


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Document]:
    try:
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = jsonsafe.loads(line)
                except ValueError as e:
                    raise NormswapError(f"{path}:{lineno}: not valid JSON ({e})") from None
                yield iter([_text_of(row, text_field, f"{path}:{lineno}")])
    except UnicodeDecodeError as e:
        raise _decode_error(path, e) from None


def _text_of(row, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise NormswapError(f"{where}: expected a JSON object with a {text_field!r} field")
    if text_field not in row:
        fields = ", ".join(sorted(map(str, row))) or "none"
        # the caller's way to pick one (open_corpus's text_field, ppl's --text-field, patch's
        # --eval-text-field); none under an entry point that reads no such option (an experiment's data)
        way = way_out("text_field", Metavar("FIELD"), "text_field=FIELD")
        raise NormswapError(f"{where}: no field {text_field!r} (fields: {fields})" + (f"; pick one with {way}" if way else ""))
    text = row[text_field]
    if not isinstance(text, str):
        raise NormswapError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text


def _require_datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise NormswapError(
            f"{path}: a dataset saved with `datasets`; reading it needs the datasets package "
            "(pip install datasets), or export the text to a .txt or .jsonl file"
        ) from None
    return datasets


def _dataset_documents(path: Path, text_field: str) -> Iterator[Document]:
    datasets = _require_datasets(path)
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise NormswapError(f"{path}: cannot load the saved dataset ({e.__class__.__name__}: {e})") from None
    if isinstance(ds, dict):  # a DatasetDict (a dict subclass): pick one split
        splits = list(ds.keys())
        split = next((s for s in _SPLIT_PREFERENCE if s in splits), splits[0] if len(splits) == 1 else None)
        if split is None:
            raise NormswapError(f"{path}: a dataset with splits {', '.join(splits)} and none named test/validation/train")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield iter([_text_of(row, text_field, f"{path} row {i}")])
