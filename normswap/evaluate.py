"""Perplexity with a sliding window, and the diff of two models scored on the same windows.

The recipe is the standard one from the transformers documentation ("Perplexity of fixed-length
models"): windows of `max_length` tokens start every `stride` tokens; in each window only the tokens
not scored by an earlier window count (the others are labels -100, context only); the mean NLL is
weighted by the number of tokens that actually contribute to the loss. Two details differ from the
documented snippet, both on purpose:

- the count of scored tokens is exact: the snippet subtracts one token per window for the label
  shift, but the shift only removes a token from the loss when that token was not already masked
  (the first window, or stride == window). Here each window says which positions it scores.
- the log-softmax, NLL and KL are computed in float64 from the model's logits (any dtype), a few
  rows at a time, so the numbers do not depend on the batch shape and memory stays bounded.

BOS: a document is encoded the way its tokenizer encodes text by default. The special tokens the
tokenizer adds around a text (BOS for Llama 2/3 and Gemma; nothing for GPT-2 or SmolLM2) are found
by encoding a probe with and without them, and are put around every document — so a model scores
its text in the form it saw in training, and no token is invented for a tokenizer that adds none.
Documents that get no special tokens are joined by a blank line, like the documented recipe.

Text is tokenised lazily, piece by piece, and windows are cut from a bounded buffer, so memory does
not grow with the corpus; logits are reduced per batch and never kept.

The noise floor: a model run in half precision is not its float32 self. Given that float32 self
(`reference=`), diff_models also scores it on the same windows and reports how far the half
original is from it and how far the patched model is; the patch is judged against that distance
(NoiseFloor), so "+0.41 %" reads as rounding or as a bug.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from normswap import data as text_data
from normswap.data import Corpus, cut_pieces, open_corpus
from normswap.errors import BadInputError, NormswapError, option_labels, using_option_names
from normswap.inputs import context_length
from normswap.progress import ProgressFn
from normswap.verify import model_output
from normswap.walk import require_module

DOCUMENT_SEPARATOR = "\n\n"
# Rows of logits turned into float64 log-probabilities at once (64 x 152k vocab = 78 MB).
_ROWS_PER_CHUNK = 64
# Texts cut after a line break that follows a non-blank character and precedes a non-blank line
# (the only cuts normswap.data makes): a tokenizer that encodes both halves into exactly the tokens
# of the whole passes; one that does not (SentencePiece adding a prefix space) gets whole documents.
_CUT_PROBES = (
    ("In the beginning.\n", "And the earth was without form"),
    ("x = f(1, 2),\n", "(y) -> z;"),
    ("chapter 3\n", "12 And the LORD God"),
    ("word\n", "Word"),
)


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float  # exp(nll)
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens that contributed to the loss
    windows: int
    max_length: int  # the longest window actually used
    stride: int  # at most max_length (a text shorter than the stride is one window: _Scoring.stride_used)

    def to_dict(self) -> dict:
        return asdict(self)


# The patch is within the half-precision noise floor while its mean KL from the float32 model is at
# most this multiple of the original's own. Why 2: a faithful kernel rounds as often as the
# original, in other places, so its distance from float32 is the original's give or take sampling
# (measured 0.9-1.1x on the tiny test models); one bug (a wrong eps, a dropped offset) moves the
# distributions by orders of magnitude more than rounding does.
NOISE_KL_FACTOR = 2.0
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Distance:
    """How far one model's next-token distributions are from the float32 reference R's."""

    delta_ppl: float  # ppl - ppl_R
    relative_delta: float  # (ppl - ppl_R) / ppl_R
    kl_mean: float  # mean KL(R || model), nats/token
    kl_max: float
    top1_agreement: float  # fraction of positions where the model's argmax is R's

    @classmethod
    def of(cls, diff: Mapping) -> Distance:
        """The distance in diff_models(R, model)'s result (a DiffResult's dict, or any mapping
        with these fields)."""
        return cls(**{f: diff[f] for f in ("delta_ppl", "relative_delta", "kl_mean", "kl_max", "top1_agreement")})


@dataclass(frozen=True)
class NoiseFloor:
    """The half-precision original A and the patched B, each against A's float32 self R."""

    dtype: str  # the half precision A and B ran in
    ppl_reference: float
    original: Distance  # A vs R: the noise floor
    patched: Distance  # B vs R
    kl_ratio: float  # patched.kl_mean / original.kl_mean (inf when the original is exact)
    limit: float  # NOISE_KL_FACTOR
    within: bool  # kl_ratio <= limit
    verdict: str  # the one line that says so

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DiffResult:
    ppl_a: float
    ppl_b: float
    delta_ppl: float  # ppl_b - ppl_a
    relative_delta: float  # (ppl_b - ppl_a) / ppl_a
    nll_a: float
    nll_b: float
    kl_mean: float  # mean over scored tokens of KL(A || B) of the next-token distributions, nats
    kl_max: float
    top1_agreement: float  # fraction of scored positions where both models' argmax agree
    max_abs_logit_diff: float
    tokens: int
    windows: int
    max_length: int
    stride: int
    noise_floor: NoiseFloor | None = field(default=None)  # set when diffed against a float32 reference

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    """`ids` are fed to the model; the tokens ids[first_target:] are scored (each predicted from
    the position before it); the earlier ones are context already scored by a previous window."""

    ids: list[int]
    first_target: int
    new_tokens: int  # tokens of the stream this window reaches for the first time (progress)

    @property
    def scored(self) -> int:
        return len(self.ids) - self.first_target


# ----------------------------------------------------------------------------- window planning


# The window options, named in messages as the caller calls them (errors.option_labels): the
# library's parameter names by default; under a command line the flags it installed with
# errors.using_option_names (`ppl --max-length`, `patch --eval-max-length`).
WINDOW_OPTIONS = ("max_length", "stride", "max_tokens", "batch_size")
# Those and the one normswap.data's messages name: what perplexity's and diff_models' caller (and
# normswap.api's EvalSettings) may rename.
SCORING_OPTIONS = (*WINDOW_OPTIONS, "text_field")


def check_window_options(max_length: int | None, stride: int | None, max_tokens: int | None = None,
                         batch_size: int = 1) -> None:
    """The checks that need no model: a CLI runs them before loading anything."""
    n = option_labels(WINDOW_OPTIONS)
    for key, value in zip(WINDOW_OPTIONS, (max_length, stride, max_tokens, batch_size), strict=True):
        # batch_size has no "default" None: None there is a wrong value, not a missing one
        if (value is not None or key == "batch_size") and (isinstance(value, bool) or not isinstance(value, int)):
            unit = "windows" if key == "batch_size" else "tokens"  # a batch counts windows per forward pass
            raise BadInputError(f"{n[key]} must be a whole number of {unit}, got {value!r}")
    if max_length is not None and max_length < 2:
        raise BadInputError(f"{n['max_length']} {max_length}: a window needs at least 2 tokens")
    if stride is not None and stride <= 0:
        raise BadInputError(f"{n['stride']} {stride}: must be a positive number of tokens")
    if stride is not None and max_length is not None and stride > max_length:
        raise BadInputError(f"{n['stride']} {stride} is larger than {n['max_length']} {max_length}: tokens "
                            "between windows would never be scored")
    if max_tokens is not None and max_tokens < 2:
        raise BadInputError(f"{n['max_tokens']} {max_tokens}: at least 2 tokens are needed to score one")
    if max_tokens is not None and max_tokens > sys.maxsize:  # what a stream can be cut at (islice)
        raise BadInputError(f"{n['max_tokens']} {max_tokens}: more tokens than any text holds "
                            f"(at most {sys.maxsize}; leave it out to score everything)")
    if batch_size < 1:
        raise BadInputError(f"{n['batch_size']} {batch_size}: must be at least 1")


def plan_window(models: Sequence, max_length: int | None, stride: int | None) -> tuple[int, int]:
    """(window, stride): the models' context capped by max_length; stride defaults to half of it."""
    check_window_options(max_length, stride)
    n = option_labels(WINDOW_OPTIONS)
    contexts = [c for c in (context_length(getattr(m, "config", None)) for m in models) if c is not None]
    context = min(contexts) if contexts else None
    if max_length is None:
        if context is None:
            raise NormswapError(f"cannot tell the model's context length from its config; pass {n['max_length']}")
        window = context
    else:
        window = min(max_length, context) if context is not None else max_length
    if stride is None:
        stride = max(1, window // 2)
    if stride <= 0:
        raise NormswapError(f"{n['stride']} {stride}: must be a positive number of tokens")
    if stride > window:
        raise NormswapError(
            f"{n['stride']} {stride} is larger than the window ({window} tokens): tokens between windows "
            "would never be scored"
        )
    return window, stride


def sliding_windows(
    token_chunks: Iterable[Sequence[int]],
    window: int,
    stride: int,
    max_tokens: int | None = None,
    short_ok: bool = True,
) -> Iterator[Window]:
    """Cut the token stream into the recipe's windows, holding at most one window of tokens.

    A stream shorter than one window is one shorter window when `short_ok` (the recipe's own
    behaviour, used when the window is the model's context) and an error otherwise (the user asked
    for windows of that length: a number measured on fewer tokens would not be comparable).
    """
    tokens = _capped(_flatten(token_chunks), max_tokens)
    buf: list[int] = []
    buf_start = 0  # absolute position of buf[0]
    exhausted = False
    begin = prev_end = 0
    while True:
        # One token of look-ahead tells whether this window is the last.
        want = begin + window + 1 - (buf_start + len(buf))
        if want > 0 and not exhausted:
            block = list(itertools.islice(tokens, want))
            buf.extend(block)
            exhausted = len(block) < want
        stream_end = buf_start + len(buf)
        end = min(begin + window, stream_end)
        if begin == 0:
            _check_first_window(end, window, max_tokens, short_ok)
        # Tokens before prev_end were scored by an earlier window; position 0 never can be (no context).
        win = Window(buf[begin - buf_start:end - buf_start], max(1, prev_end - begin), end - prev_end)
        if win.scored > 0:  # with stride == window a last window of 1 token has nothing to score
            yield win
        prev_end = end
        if end == stream_end:
            return
        begin += stride
        del buf[:begin - buf_start]
        buf_start = begin


def _check_first_window(tokens: int, window: int, max_tokens: int | None, short_ok: bool,
                        at_most: str | None = None) -> None:
    """Refuse a first window of `tokens` tokens (the text's, capped by the window and max_tokens) that
    cannot be scored as asked (sliding_windows). at_most: `tokens` is only the most the text can
    hold, for the reason given (a tokenizer not made yet: check_before_tokenizing); what is refused
    then is refused for any count up to it, and the messages say "at most"."""
    n = option_labels((*WINDOW_OPTIONS, "data"))
    count = f"{tokens} token{'s' * (tokens != 1)}"
    if at_most is not None:
        count = f"at most {count} ({at_most})"
    # Which text, as the training texts' messages say theirs (data.train: ...): an experiment scores
    # data.eval, and `patch --eval` / `ppl --data` a file (_Scoring names its path).
    text = f"{n['data']}: the text"
    if tokens < 2:
        raise NormswapError(f"{text} has {count}; at least 2 are needed to score one")
    if tokens < window and not short_ok and tokens == max_tokens:
        raise NormswapError(f"{n['max_tokens']} {max_tokens} is shorter than one window ({window} tokens)")
    if tokens < window and not short_ok:
        # A bound is no count to pass: the text's tokens are likely fewer, and a window of the
        # bound would pass this check only to be refused once the tokenizer exists (after the
        # pretraining, hours in).
        fits = (f"{n['max_length']} {tokens} or less" if at_most is None else
                f"{n['max_length']} no more than its token count, which only the tokenizer tells (likely under {tokens})")
        raise NormswapError(f"{text} is shorter than one window: {count}, window {window}; pass {fits}, or more text")


def _flatten(chunks: Iterable[Sequence[int]]) -> Iterator[int]:
    for chunk in chunks:
        yield from chunk


def _capped(tokens: Iterator[int], max_tokens: int | None) -> Iterator[int]:
    return tokens if max_tokens is None else itertools.islice(tokens, max_tokens)


def batched_windows(windows: Iterable[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows of equal length, up to batch_size of them: no padding is ever needed
    (only the last window of a stream can be shorter)."""
    batch: list[Window] = []
    for w in windows:
        if batch and (len(batch) == batch_size or len(w.ids) != len(batch[0].ids)):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


# ----------------------------------------------------------------------------- tokenisation


def _encode(tokenizer, text: str) -> list[int]:
    # verbose=False: long pieces exceed model_max_length on purpose (windows are cut later).
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text by default (e.g. [BOS], [])."""
    probe = "Hello world"
    plain = _encode(tokenizer, probe)
    full = list(tokenizer(probe, add_special_tokens=True, verbose=False)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def _cuts_are_exact(tokenizer) -> bool:
    return all(_encode(tokenizer, a) + _encode(tokenizer, b) == _encode(tokenizer, a + b) for a, b in _CUT_PROBES)


def document_tokens(tokenizer, documents: Iterable[Iterable[str]]) -> Iterator[list[int]]:
    """Token chunks of the documents, one after another, each wrapped as its tokenizer wraps text."""
    prefix, suffix = special_affixes(tokenizer)
    separated_by_text = not prefix and not suffix
    exact_cuts = _cuts_are_exact(tokenizer)
    first_document = True
    for doc in documents:
        # bounded pieces whatever the source (a str, a jsonl row, a dataset row may be one huge
        # line); a tokenizer whose encoding changes at a cut gets them joined up to the cap
        pieces = cut_pieces(doc) if exact_cuts else cut_pieces(doc, first=text_data.MAX_PIECE_CHARS)
        started = False
        for piece in pieces:
            if not started:
                if not piece.strip():
                    continue  # empty rows (common in jsonl corpora) are not documents
                head = DOCUMENT_SEPARATOR if separated_by_text and not first_document else ""
                yield list(prefix) + _encode(tokenizer, head + piece)
                started, first_document = True, False
            else:
                yield _encode(tokenizer, piece)
        if started and suffix:
            yield list(suffix)


def token_chunks(tokenizer, data, text_field: str = "text") -> Iterator[Sequence[int]]:
    """Accepts: a str (one text), a Path or Corpus (read lazily), an iterable of str (documents),
    a 1-D tensor or numpy array or an iterable of ints (token ids, taken verbatim), or an iterable
    of token-id sequences (chunks of one stream). Anything else, or a mix, is refused naming what it
    got: bytes and mappings are iterable too, and were read as token ids and as their keys."""
    if _numpy_kind(data, "ndarray") and data.dtype.kind in "biuf":
        data = torch.as_tensor(data)
    if isinstance(data, torch.Tensor):
        return iter([_tensor_ids(data)])
    if isinstance(data, (str, os.PathLike, Corpus)):
        if isinstance(data, str):
            documents: Iterable = [iter([data])]
        else:
            corpus = data if isinstance(data, Corpus) else open_corpus(data, text_field)
            documents = corpus.documents()
        return document_tokens(_need_tokenizer(tokenizer), documents)
    _refuse_misread("data", data)
    try:
        items = iter(data)
    except TypeError:
        raise TypeError(f"data: expected a text, documents, a data path or token ids, got {type(data).__name__}") from None
    try:
        head = next(items)
    except StopIteration:
        return iter(())
    items = itertools.chain([head], items)
    if isinstance(head, str):
        return document_tokens(_need_tokenizer(tokenizer), (iter([_document(t)]) for t in items))
    if isinstance(head, Mapping):
        raise TypeError(f"data: rows that are {type(head).__name__}s (a datasets.Dataset?); pass their texts, "
                        f"e.g. ds[{text_field!r}]")
    if _is_token_id(head):
        return iter([[_token_id(t) for t in items]]) if isinstance(data, Sequence) else _singletons(items)
    return (_chunk_ids(t) for t in items)


def _refuse_misread(name: str, value) -> None:
    """bytes iterate as ints and a mapping as its keys: either would be scored as something else."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name}: {type(value).__name__}; decode them (.decode('utf-8')) or pass the file's path")
    if isinstance(value, Mapping):
        raise TypeError(f"{name}: a {type(value).__name__}; pass its text (e.g. data['text']), documents or token ids")


def _document(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"data: documents must be texts, got {type(text).__name__}")
    return text


def _numpy_kind(value, kind: str) -> bool:
    """Whether `value` is a numpy `kind` ("ndarray"; "generic": a scalar such as numpy.int64); numpy
    is not imported for it: such a value only comes from a program that imported it."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, getattr(numpy, kind))


def _is_token_id(value) -> bool:
    # a numpy scalar, not an array: a list of arrays is chunks of ids, as a list of tensors is
    return isinstance(value, int) or (isinstance(value, torch.Tensor) and value.dim() == 0) or \
        _numpy_kind(value, "generic")


def _token_id(value) -> int:
    """One given token id. int() would take 6.7 as 6 and True as 1: a wrong score with no complaint."""
    if isinstance(value, torch.Tensor):
        return _tensor_ids(value.reshape(1))[0]
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        try:
            return operator.index(value)  # int, numpy's integers
        except TypeError:
            pass
    raise BadInputError(f"token ids must be integers, got {type(value).__name__} {value!r}")


def _tensor_ids(data: torch.Tensor) -> list[int]:
    if data.dim() == 2 and data.shape[0] == 1:
        data = data[0]
    if data.dim() != 1:
        raise NormswapError(f"token ids must be a 1-D tensor (or 1 x N), got shape {tuple(data.shape)}")
    if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        # tolist() would hand on 1.5 and int() make it 1: a wrong score with no complaint
        raise BadInputError(f"token ids must be integers, got a {data.dtype} tensor")
    return data.tolist()


def _chunk_ids(chunk) -> list[int]:
    if isinstance(chunk, torch.Tensor) or _numpy_kind(chunk, "ndarray"):
        return _tensor_ids(torch.as_tensor(chunk))
    if isinstance(chunk, str) or not isinstance(chunk, Iterable):
        raise BadInputError(f"token ids must be integers, got {type(chunk).__name__} {chunk!r}")
    _refuse_misread("data", chunk)
    return [_token_id(t) for t in chunk]


def _singletons(items: Iterator) -> Iterator[list[int]]:
    for t in items:
        yield [_token_id(t)]


def _need_tokenizer(tokenizer):
    if tokenizer is None:
        raise NormswapError("scoring text needs the model's tokenizer (pass token ids to score without one)")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer: expected a tokenizer (transformers.AutoTokenizer), got {type(tokenizer).__name__}")
    return tokenizer


# ----------------------------------------------------------------------------- scoring


def _check_causal(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise NormswapError(
            f"{_model_name(model)} is an encoder-decoder model; perplexity here needs a causal language model"
        )


def _vocabulary_size(model) -> int | None:
    """Rows of the input embedding table (the config's vocab_size before the weights are loaded)."""
    if isinstance(model, _ConfigOnly):
        size = getattr(model.config, "vocab_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
    get = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    size = getattr(embeddings, "num_embeddings", None)
    return size if isinstance(size, int) else None


@dataclass(frozen=True)
class _ConfigOnly:
    """Stands in for a model whose weights are not loaded yet: window planning and the checks
    before scoring read only `config`."""

    config: object


def _model_name(model) -> str:
    if isinstance(model, _ConfigOnly):
        names = getattr(model.config, "architectures", None) or [getattr(model.config, "model_type", "the model")]
        return str(names[0])
    return type(model).__name__


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    kind, logits = model_output(model, {"input_ids": ids, "use_cache": False}, raw=True)
    if kind != "logits":
        raise NormswapError(f"{type(model).__name__} returns no logits (a model without a language-model head?)")
    return logits


def _scored_rows(logits: torch.Tensor, batch: list[Window]) -> torch.Tensor:
    """[M, V] logits at the positions that predict scored tokens, in window order."""
    return torch.cat([logits[i, w.first_target - 1:-1] for i, w in enumerate(batch)])


def _scored_targets(batch: list[Window]) -> torch.Tensor:
    return torch.tensor([t for w in batch for t in w.ids[w.first_target:]], dtype=torch.long)


def _row_chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    for start in range(0, tensors[0].shape[0], _ROWS_PER_CHUNK):
        yield tuple(t[start:start + _ROWS_PER_CHUNK] for t in tensors)


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    total = 0.0
    for rows, tgt in _row_chunks(logits, targets.to(logits.device)):
        logp = torch.log_softmax(rows.double(), dim=-1)
        total += -logp.gather(1, tgt[:, None]).sum().item()
    return total


def _ppl(nll: float) -> float:
    return math.exp(nll) if nll < 709.0 else math.inf


class _Scoring:
    """Plans the windows, drives the models over them batch by batch, with a progress bar."""

    def __init__(self, models, tokenizer, data, *, max_length, stride, max_tokens, batch_size, progress,
                 text_field, desc):
        for m in models:
            _check_causal(m)
        check_window_options(max_length, stride, max_tokens, batch_size)
        self.window, self.stride = plan_window(models, max_length, stride)
        windows = sliding_windows(token_chunks(tokenizer, data, text_field), self.window, self.stride,
                                  max_tokens, short_ok=max_length is None)
        limits = [v for v in (_vocabulary_size(m) for m in models) if v is not None]
        self.vocab_limit = min(limits) if limits else None
        # Cut the first window before the bar appears: bad input fails with a clean line, naming a
        # text read from a file by its path, as normswap.data's messages do (what `data` is called
        # otherwise: the names in effect). Installed with the scoring options' names (those in
        # effect, else the parameters'): a name alone would read, to errors.way_out, as an entry
        # point without text_field, and a direct call of perplexity on a .jsonl would lose its
        # "pick one with text_field=FIELD".
        path = data.path if isinstance(data, Corpus) else data if isinstance(data, os.PathLike) else None
        with using_option_names(None if path is None else option_labels(SCORING_OPTIONS) | {"data": os.fspath(path)}):
            first = next(windows)
        self._check_ids(first.ids)
        self.windows = itertools.chain([first], windows)
        self.models, self.max_tokens, self.batch_size = models, max_tokens, batch_size
        self.progress, self.desc = progress, desc
        self.count = self.longest = self.tokens = 0

    @property
    def stride_used(self) -> int:
        """The stride the results report: the planned one, or the longest window when that is
        shorter (a text shorter than the stride is one window; a stride of 1024 beside a
        max_length of 40 described windows that never were)."""
        return min(self.stride, self.longest) if self.longest else self.stride

    def _check_ids(self, ids: Sequence[int]) -> None:
        """A token id past the embedding table would crash the forward with an IndexError: the
        tokenizer does not belong to the model."""
        if ids and min(ids) < 0:
            raise BadInputError(f"token id {min(ids)} is negative; token ids index the embedding table")
        if self.vocab_limit is not None and ids and max(ids) >= self.vocab_limit:
            raise NormswapError(
                f"token id {max(ids)} is past the model's {self.vocab_limit} token embeddings: the tokenizer "
                "does not belong to this model, or the token ids given were not made for it"
            )

    def batches(self) -> Iterator[tuple[list[Window], list[torch.Tensor], torch.Tensor]]:
        """(windows, scored-row logits per model, scored targets) for each batch."""
        from normswap.progress import bar as progress_bar

        bar = progress_bar(self.progress, self.desc, self.max_tokens, unit="tok")
        # Dropout off while scoring (deterministic numbers); the caller's mode is restored after.
        modes = [getattr(m, "training", False) for m in self.models]
        for m in self.models:
            m.eval()
        try:
            yield from self._batches(bar)
        finally:
            for m, mode in zip(self.models, modes, strict=True):
                m.train(mode)

    def _batches(self, bar) -> Iterator[tuple[list[Window], list[torch.Tensor], torch.Tensor]]:
        with bar, torch.inference_mode():
            for batch in batched_windows(self.windows, self.batch_size):
                for w in batch:
                    self._check_ids(w.ids)
                ids = torch.tensor([w.ids for w in batch], dtype=torch.long)
                rows = [_scored_rows(_logits(m, ids), batch) for m in self.models]
                yield batch, rows, _scored_targets(batch)
                self.count += len(batch)
                self.longest = max(self.longest, len(batch[0].ids))
                self.tokens += sum(w.scored for w in batch)
                bar.update(sum(w.new_tokens for w in batch))


def check_before_loading(configs: Sequence, tokenizer, data, max_length: int | None = None,
                         stride: int | None = None, max_tokens: int | None = None, batch_size: int = 1,
                         text_field: str = "text", model_class: Callable | None = None) -> None:
    """Raise the NormswapError that `perplexity` / `diff_models` would raise for these options and
    this data (encoder-decoder, no language-model head, unknown context length, stride past the
    window, text shorter than one window, ...), from the models' configs and the tokenizer alone. A CLI calls it before it
    loads any weights, so bad input fails fast and with nothing but its one line on stderr.

    model_class(config): the class a config builds (normswap.loading.model_class), for the
    language-model head check; the caller passes it because loading.py sits above this module."""
    _Scoring([_ConfigOnly(c) for c in configs], tokenizer, data, max_length=max_length, stride=stride,
             max_tokens=max_tokens, batch_size=batch_size, progress=False, text_field=text_field, desc="")
    if model_class is not None:
        check_language_model_heads(configs, model_class)


def check_language_model_heads(configs: Sequence, model_class: Callable) -> None:
    """Refuse, from the configs alone (before a tokenizer is even looked for), a model that has
    no language-model head: model_class(config) as for check_before_loading."""
    for config in configs:
        _check_language_model_head(model_class(config))


def check_before_tokenizing(configs: Sequence, most_tokens: int, why: str, max_length: int | None = None,
                            stride: int | None = None, max_tokens: int | None = None, batch_size: int = 1) -> None:
    """check_before_loading for a text whose tokenizer is not made yet (an experiment's [pretrain]
    trains it): the window options against each other and the models' context, and the text
    against the first window by `most_tokens`, the most tokens the tokenizer can make of it (`why`
    says why, in the message). It refuses only what scoring would refuse whatever the count up to
    that bound; the count itself is checked once the tokenizer exists."""
    models = [_ConfigOnly(c) for c in configs]
    for m in models:
        _check_causal(m)
    check_window_options(max_length, stride, max_tokens, batch_size)
    window, _ = plan_window(models, max_length, stride)
    first = min(window, most_tokens, most_tokens if max_tokens is None else max_tokens)
    # a message that counts the text's tokens (the bound is the smallest) says the count is a bound
    _check_first_window(first, window, max_tokens, max_length is None, at_most=why if first == most_tokens else None)


def _check_language_model_head(cls) -> None:
    """Refuse, before any weights load, a model that returns no logits: the class the config builds
    must be one of transformers' generating classes (every causal LM is; a bare encoder such as
    BertModel returns hidden states). Scoring a loaded model still checks for logits itself."""
    if not cls.can_generate():
        main = getattr(cls, "main_input_name", "input_ids")
        reads = f"; it reads {main}, not token ids" if main != "input_ids" else ""
        raise NormswapError(f"{cls.__name__} has no language-model head (no logits to score{reads}); perplexity "
                            "needs a causal language model")


def perplexity(model, tokenizer, data, max_length: int | None = None,
               stride: int | None = None, max_tokens: int | None = None, batch_size: int = 1,
               progress: bool | ProgressFn = True,
               text_field: str = "text", option_names: Mapping[str, str] | None = None) -> PerplexityResult:
    """Sliding-window perplexity of `model` on `data`: a text (str), documents (iterable of str), a data
    PATH (pathlib.Path or normswap.data.open_corpus(PATH)) or token ids (tensor or ints).

    max_length caps the window (default: the model's context); stride defaults to half the window;
    max_tokens keeps only the first tokens of the corpus. progress: True draws a bar on stderr; a
    callable gets progress("perplexity", tokens done, max_tokens). Raises NormswapError on bad input
    (BadInputError for a value no window can have). option_names: what messages call
    SCORING_OPTIONS (default: the names in effect, errors.using_option_names: the parameters', or
    what an outer entry point such as normswap.api's was told).
    """
    with _using_given_scoring_names(option_names):
        return _perplexity(model, tokenizer, data, max_length, stride, max_tokens, batch_size, progress, text_field)


def _using_given_scoring_names(option_names: Mapping[str, str] | None):
    """Installs perplexity's and diff_models' option_names when given: they make the call an entry
    point of its own (every SCORING_OPTIONS named, so normswap.data's way_out offers its
    text_field); none leave the names in effect alone (under an api entry point, whose
    api._using_entry_point_names named them, or an experiment, which has no text_field to offer)."""
    return using_option_names(option_labels(SCORING_OPTIONS, option_names) if option_names else None)


def _perplexity(model, tokenizer, data, max_length, stride, max_tokens, batch_size, progress,
                text_field) -> PerplexityResult:
    require_module(model, weights=True)
    run = _Scoring([model], tokenizer, data, max_length=max_length, stride=stride,
                   max_tokens=max_tokens, batch_size=batch_size, progress=progress, text_field=text_field,
                   desc="perplexity")
    total = 0.0
    for _, (rows,), targets in run.batches():
        total += _nll_sum(rows, targets)
    nll = total / run.tokens
    return PerplexityResult(ppl=_ppl(nll), nll=nll, tokens=run.tokens, windows=run.count,
                            max_length=run.longest, stride=run.stride_used)


def diff_models(model_a, model_b, tokenizer, data, max_length: int | None = None, stride: int | None = None,
                max_tokens: int | None = None, batch_size: int = 1,
                progress: bool | ProgressFn = True,
                text_field: str = "text", reference=None,
                option_names: Mapping[str, str] | None = None) -> DiffResult:
    """Score both models on the same windows and compare their next-token distributions.

    KL(A || B) = sum_v pA(v) (log pA(v) - log pB(v)) per scored position, from float64 log-softmax.
    `data` takes what `perplexity` takes; a data PATH must be a pathlib.Path or
    normswap.data.open_corpus(PATH) (a plain str is scored as the text itself).
    reference: A's float32 self (A in half precision, loaded again in float32), scored on the same
    windows: the result's noise_floor then says how far A and B each are from it (module doc).
    This is also what `normswap patch ... --eval PATH` reports: diff_models(original,
    patched_copy(original, impl), tokenizer, open_corpus(PATH), ...). option_names: perplexity's.
    """
    with _using_given_scoring_names(option_names):
        return _diff_models(model_a, model_b, tokenizer, data, max_length, stride, max_tokens, batch_size, progress,
                            text_field, reference)


def _diff_models(model_a, model_b, tokenizer, data, max_length, stride, max_tokens, batch_size, progress,
                 text_field, reference) -> DiffResult:
    for name, m in (("model_a", model_a), ("model_b", model_b), ("reference", reference)):
        if m is not None or name != "reference":
            require_module(m, name, weights=True)
    models = [model_a, model_b] + ([reference] if reference is not None else [])
    run = _Scoring(models, tokenizer, data, max_length=max_length, stride=stride,
                   max_tokens=max_tokens, batch_size=batch_size, progress=progress, text_field=text_field,
                   desc="diff")
    ab, ra, rb = _PairStats(), _PairStats(), _PairStats()
    for _, rows, targets in run.batches():
        widths = {r.shape[-1] for r in rows}
        if len(widths) > 1:
            raise NormswapError(
                f"the models have different vocabularies ({' vs '.join(str(r.shape[-1]) for r in rows)} logits)"
            )
        device = rows[0].device
        for chunk in _row_chunks(*(r.to(device) for r in rows), targets.to(device)):
            *logits, tgt = chunk
            logp = [torch.log_softmax(x.double(), dim=-1) for x in logits]
            ab.add(logits[0], logits[1], logp[0], logp[1], tgt)
            if reference is not None:
                ra.add(logits[2], logits[0], logp[2], logp[0], tgt)
                rb.add(logits[2], logits[1], logp[2], logp[1], tgt)
    n = run.tokens
    d = ab.result(n)
    noise = None
    if reference is not None:
        r = ra.result(n)
        noise = judge_noise(r, rb.result(n), str(_dtype_of(model_a)).removeprefix("torch."), r["ppl_a"])
    return DiffResult(**d, tokens=n, windows=run.count, max_length=run.longest, stride=run.stride_used,
                      noise_floor=noise)


class _PairStats:
    """Running sums for the comparison of two models' scored rows (A, B)."""

    def __init__(self):
        self.nll_a = self.nll_b = self.kl_sum = self.kl_max = self.max_abs = 0.0
        self.agree = 0

    def add(self, a, b, logp_a, logp_b, tgt) -> None:
        self.nll_a -= logp_a.gather(1, tgt[:, None]).sum().item()
        self.nll_b -= logp_b.gather(1, tgt[:, None]).sum().item()
        # Tokens A rules out (logit -inf, e.g. a masked padding slot of the vocabulary) add
        # 0 * (-inf - x) = nan in the plain formula; by definition they add nothing.
        kl = torch.where(logp_a == -math.inf, 0.0, logp_a.exp() * (logp_a - logp_b)).sum(-1)
        self.kl_sum += kl.sum().item()
        self.kl_max = max(self.kl_max, kl.max().item())
        self.agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        a64, b64 = a.double(), b.double()
        # Equal logits differ by 0, the infinite ones included (inf - inf would be nan).
        self.max_abs = max(self.max_abs, torch.where(a64 == b64, 0.0, (a64 - b64).abs()).max().item())

    def result(self, n: int) -> dict:
        nll_a, nll_b = self.nll_a / n, self.nll_b / n
        ppl_a, ppl_b = _ppl(nll_a), _ppl(nll_b)
        return dict(ppl_a=ppl_a, ppl_b=ppl_b, delta_ppl=ppl_b - ppl_a, relative_delta=(ppl_b - ppl_a) / ppl_a,
                    nll_a=nll_a, nll_b=nll_b, kl_mean=self.kl_sum / n, kl_max=self.kl_max,
                    top1_agreement=self.agree / n, max_abs_logit_diff=self.max_abs)


def _describe_distance(x: Distance) -> str:
    return f"{100 * x.relative_delta:+.3g}% ppl, KL {x.kl_mean:.3g}, top-1 {100 * x.top1_agreement:.2f}%"


def describe_floor(dtype: str, original: Distance) -> str:
    """The noise floor itself, in the words every verdict starts with."""
    return f"{dtype} noise floor: the original is {_describe_distance(original)} from its float32 self"


def judge_noise(original: Mapping, candidate: Mapping, dtype: str, ppl_reference: float,
                name: str = "the patched model") -> NoiseFloor:
    """Judge `candidate` against the `dtype` noise floor `original`. Both are distances from the
    float32 reference R as diff_models(R, X) reports them (a DiffResult's dict, or any mapping with
    Distance's fields); ppl_reference is R's perplexity on the same windows. The one judgement that
    diff_models(reference=...) and the experiment's arms both use; `name` calls the candidate in
    the verdict."""
    original_d, candidate_d = Distance.of(original), Distance.of(candidate)
    if original_d.kl_mean > 0:
        ratio = candidate_d.kl_mean / original_d.kl_mean
    else:
        ratio = 1.0 if candidate_d.kl_mean == 0 else math.inf
    within = ratio <= NOISE_KL_FACTOR
    verdict = (f"{describe_floor(dtype, original_d)}, {name} {_describe_distance(candidate_d)}: "
               f"{'within' if within else 'OUTSIDE'} the {dtype} noise (KL to float32 "
               f"{ratio:.3g}x the original's, limit {NOISE_KL_FACTOR:g}x)")
    return NoiseFloor(dtype=dtype, ppl_reference=ppl_reference, original=original_d, patched=candidate_d,
                      kl_ratio=ratio, limit=NOISE_KL_FACTOR, within=within, verdict=verdict)


def _dtype_of(model) -> torch.dtype:
    try:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())
    except (StopIteration, AttributeError):
        return torch.float32


def patched_copy(model, impl: str):
    """A copy of `model` with its norms swapped for `impl` (the original is left untouched, so
    the two can be diffed). Each swapped module is verified, as in `normswap patch`."""
    from normswap.swap import patch

    twin = copy.deepcopy(model)
    patch(twin, impl=impl)
    return twin
