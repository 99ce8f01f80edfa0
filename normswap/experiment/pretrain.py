"""The `[pretrain]` stage: a small GPT-2-architecture model trained from scratch on a text.

No LayerNorm model's weights can be downloaded where normswap is developed, so a recipe can make
its own: a byte-level BPE tokenizer trained on the text (the `tokenizers` library), a GPT2LMHeadModel
of the recipe's shape (dropout off: the runs are deterministic and a few epochs at most), trained
with the same loop as every arm. The result is a stock transformers checkpoint (config, safetensors,
tokenizer) cached under ~/.cache/normswap/pretrain/<name>-<key>/, where the key hashes the
[pretrain] section, the seed and the text; an interrupted pretraining resumes from
<that dir>.partial/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import warnings
from collections import Counter
from pathlib import Path

import torch

from normswap import jsonsafe
from normswap.dtypes import parse_dtype
from normswap.errors import NormswapError, using_option_names
from normswap.experiment import processes
from normswap.experiment.recipe import PretrainSection, RecipeError, file_digest
from normswap.experiment.trainer import (
    RandomWindows,
    StopFlag,
    check_training_text,
    physical_memory,
    resolve_mixed_precision,
    train,
)
from normswap.progress import ProgressBars

EOS = "<|endoftext|>"
INFO_FILE = "normswap-pretrain.json"


def read_text(path: str | Path) -> str:
    """The whole text of a data PATH (anything normswap.data.open_corpus takes), documents joined
    by a blank line."""
    from normswap.data import open_corpus

    return "\n\n".join("".join(doc) for doc in open_corpus(path).documents())


def cache_key(section: PretrainSection, seed: int, text_digest: str | None = None) -> str:
    """The [pretrain] section, the seed and the text by its content. text_digest: file_digest of
    section.text, when the caller has taken it (Recipe.text_digests: a run takes each once, a
    read of the whole file); None takes it here."""
    d = dataclasses.asdict(section)
    # "auto" is bf16 on one machine and none on another (resolve_mixed_precision): keyed as it
    # resolves, or a cache shared by a GPU machine and a CPU one handed either the other's weights.
    # Left "auto" where it means none: the key the CPU entries made before this had.
    if section.mixed_precision == "auto" and (mp := resolve_mixed_precision("auto")) != "no":
        d["mixed_precision"] = mp
    d["text"] = file_digest(section.text) if text_digest is None else text_digest
    d["seed"] = seed
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def pretrain_dir(section: PretrainSection, seed: int, name: str, text_digest: str | None = None) -> Path:
    """The cache entry of this pretraining (text_digest: as cache_key takes it)."""
    from normswap.loading import cache_dir

    return cache_dir() / "pretrain" / f"{name}-{cache_key(section, seed, text_digest)}"


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on `text`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The trainer reserves room for vocab_size entries up front (some 70 bytes each): vocab_size =
    # 10**9 aborted the process inside Rust (no exception, no line). It can never make more than
    # the alphabet, EOS and one merge per byte of the text, so asking for more changes nothing.
    vocab_size = min(vocab_size, most_vocabulary(most_tokens(text)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   model_max_length=1 << 30)


# Why a text of n bytes makes at most n tokens (most_tokens), as messages give it.
ONE_TOKEN_PER_BYTE = "one per byte of the text at most: the tokenizer [pretrain] trains is byte-level BPE"


def most_tokens(text: str) -> int:
    """The most tokens a train_tokenizer tokenizer makes of `text`: its UTF-8 byte count. The
    byte-level pre-tokenizer turns every byte into one symbol of the initial alphabet (all 256 are
    in it, so none is unknown), BPE merges only ever join symbols, and the special token (EOS)
    spans 13 bytes: every token covers at least one byte. What the pretrained model's scoring and
    training would refuse for too few tokens is found with it before the pretraining."""
    return len(text.encode("utf-8", "surrogatepass"))


def most_vocabulary(tokens: int) -> int:
    """The most entries a train_tokenizer tokenizer can have of a text of at most `tokens` tokens
    (most_tokens: its bytes): the 256 bytes, EOS, and one per merge, each of which joins a pair of
    symbols that stand in the text (at most one per byte). From the bound, not the text: the checks
    before a pretraining take it once (an encode of the whole text each time)."""
    return 256 + 1 + tokens


def parameter_count(section: PretrainSection, vocab_size: int) -> int:
    """The parameters of [pretrain]'s GPT-2 (model_config) with `vocab_size` tokens, from its shape
    alone: token and position tables, per block two LayerNorms, the fused qkv and output
    projections and the 4x MLP (12 e^2 + 13 e), the final LayerNorm; the head is tied."""
    e = section.n_embd
    return (vocab_size + section.context) * e + section.n_layer * (12 * e * e + 13 * e) + 2 * e


def check_model_fits(section: PretrainSection, tokens: int) -> None:
    """Refuse a [pretrain] model whose float32 weights alone (GPT-2's parameter count for the
    section's shape, its vocabulary as large as a text of at most `tokens` tokens allows:
    most_tokens of pretrain.text) take more than the machine's memory: n_embd = 2**40 was an
    internal error from the allocator, and n_layer = 2**40 built layer after layer until the
    machine ran out (its training needs some four times this)."""

    params = parameter_count(section, min(section.vocab_size, most_vocabulary(tokens)))
    need, have = 4 * params, physical_memory()
    if have is not None and need > have:
        raise NormswapError(f"pretrain: a model of {params:,} parameters takes {need / 2**30:,.1f} GiB in float32, "
                            f"more than this machine's {have / 2**30:,.1f} GiB of memory; lower n_layer, n_embd, "
                            "context or vocab_size")


def model_config(section: PretrainSection, vocab_size: int, eos_id: int):
    """The GPT2Config of [pretrain]'s model (its context is pretrain.context's positions)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size, n_positions=section.context, n_embd=section.n_embd, n_layer=section.n_layer,
        n_head=section.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        initializer_range=section.init_std, bos_token_id=eos_id, eos_token_id=eos_id,
    )


def build_model(section: PretrainSection, vocab_size: int, eos_id: int, seed: int):
    from transformers import GPT2LMHeadModel

    config = model_config(section, vocab_size, eos_id)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def _heldout_windows(section: PretrainSection) -> dict:
    """The window options of the pretraining's held-out perplexity (a window of pretrain.context)."""
    return {"max_length": section.context, "batch_size": 8}


# Its window is pretrain.context, so its messages name that key, not the data.eval_* keys
# run_experiment installs for the experiment's own evaluations.
_HELDOUT_NAMES = {"max_length": "pretrain.context"}


def check_pretraining_texts(section: PretrainSection, tokens: int, eval_tokens: int) -> None:
    """What the pretraining would refuse for too few tokens once its tokenizer is trained, found
    before by most_tokens' bound (`tokens` of pretrain.text, `eval_tokens` of the held-out text:
    the caller counts each text once, and shares a count between texts that are one file):
    pretrain.text against one sequence, and the held-out text against the held-out perplexity's
    window. The exact counts are checked again after the tokenizer. And a model too large for the
    machine (check_model_fits)."""
    try:
        check_training_text(tokens, section.seq_len, ONE_TOKEN_PER_BYTE)
    except NormswapError as e:
        raise NormswapError(f"pretrain.text: {e}") from None
    check_model_fits(section, tokens)
    from normswap.evaluate import check_before_tokenizing

    with using_option_names(_HELDOUT_NAMES):
        check_before_tokenizing([model_config(section, section.vocab_size, 0)], eval_tokens,
                                ONE_TOKEN_PER_BYTE, **_heldout_windows(section))


def check_pretraining_precision(section: PretrainSection, run_precision: str) -> None:
    """Refuse to pretrain under another mixed precision than pretrain.mixed_precision says.
    accelerate keeps one per process, the run's Accelerator's (from finetune.mixed_precision): the
    pretraining ran under it whatever [pretrain] said, and its cache entry, keyed by the section,
    then held weights trained otherwise than the key says, reused by every later run of the section
    (finetune.mixed_precision = "bf16" on a CPU pretrained in bf16 under the key of float32)."""
    want = resolve_mixed_precision(section.mixed_precision)
    if want != run_precision:
        raise RecipeError(f"pretrain.mixed_precision: {section.mixed_precision!r} is {want!r} here, but this run "
                          f"trains under {run_precision!r} (finetune.mixed_precision; accelerate keeps one mixed "
                          f"precision per process): set pretrain.mixed_precision = {run_precision!r} or "
                          f"finetune.mixed_precision = {want!r}")


# A text this long (in characters) takes seconds to tokenize or to train a tokenizer on (the smoke
# recipe's 3 MB: 8 s to encode on this project's machine under load): such a stage gets a bar, where
# there was silence (a 100 MB text: minutes before the first bar). A shorter one is not worth a line.
LONG_TEXT = 1 << 20


@contextlib.contextmanager
def text_stage(desc: str, text: str, progress: bool):
    """A one-step bar on stderr (desc, then its time) around work on `text` when it is LONG_TEXT or
    longer and progress is on; nothing otherwise."""
    from normswap.progress import stderr_bar

    with stderr_bar(total=1, desc=desc, unit="text", disable=not progress or len(text) < LONG_TEXT) as bar:
        yield
        bar.update(1)


def encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def unigram_perplexity(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the held-out tokens under the training text's token frequencies (add-one
    smoothed): the bar a model that ignores context reaches."""
    counts = Counter(train_ids.tolist())
    total = train_ids.numel() + vocab_size
    nll = -sum(math.log((counts.get(t, 0) + 1) / total) for t in eval_ids.tolist()) / eval_ids.numel()
    return math.exp(nll)


def ensure_pretrained(accelerator, section: PretrainSection, seed: int, name: str, eval_text: str,
                      *, text: str | None = None, text_digest: str | None = None, stop: StopFlag | None = None,
                      progress: bool = True, tokens: dict[str, torch.Tensor] | None = None) -> tuple[Path, dict]:
    """The cached checkpoint directory for this [pretrain] section (training it first when absent)
    and its info (steps, time, held-out perplexity, unigram baseline). eval_text: the held-out
    text's contents (read_text of data.eval, which the runner has read for its own evaluations: it
    was read again here). text: section.text's contents (read_text) when the caller has read them
    already (the runner, for its check before the run): a large text is seconds a read; None reads
    them if the pretraining runs. text_digest: its file_digest, as cache_key takes it. tokens: a
    dict that gets section.text's token ids under "text" when the pretraining runs (it tokenizes
    the text with the model's tokenizer: the runner's data.train, when it is that text, is not
    tokenized again)."""
    from normswap.checkpoint import target_lock

    final = pretrain_dir(section, seed, name, text_digest)
    with processes.together():  # every process reads a cached entry's record: its refusal said once
        cached = _read_info(final) if (final / INFO_FILE).is_file() else None
    if cached is not None:
        return final, cached
    lock = contextlib.nullcontext()
    if accelerator.is_main_process:
        # Two experiments sharing a [pretrain] section (two --out folders, two terminals) would train
        # into one .partial folder, each resuming from and removing the other's checkpoints.
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = target_lock(final.resolve())  # the key staged_dir takes it under below (re-entrant)
    with lock:
        if (final / INFO_FILE).is_file():  # published by a run that held the lock until just now
            return final, _read_info(final)
        return _pretrain(accelerator, section, seed, final, eval_text, text, stop=stop, progress=progress,
                         tokens=tokens)


def _pretrain(accelerator, section: PretrainSection, seed: int, final: Path, eval_text: str,
              text: str | None, *, stop: StopFlag | None, progress: bool,
              tokens: dict[str, torch.Tensor] | None = None) -> tuple[Path, dict]:
    """ensure_pretrained's training, under the cache entry's lock."""
    from transformers import PreTrainedTokenizerFast

    from normswap.checkpoint import staged_dir

    check_pretraining_precision(section, accelerator.mixed_precision)  # a caller's accelerator too
    partial = final.with_name(final.name + ".partial")
    tok_dir = partial / "tokenizer"
    text = read_text(section.text) if text is None else text
    with processes.together():
        if accelerator.is_main_process and not (tok_dir / "tokenizer.json").is_file():
            tok_dir.mkdir(parents=True, exist_ok=True)
            tmp = partial / "tokenizer.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            with text_stage("pretrain: train the tokenizer", text, progress):
                tokenizer = train_tokenizer(text, section.vocab_size)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(tok_dir)
            tmp.rename(tok_dir)
    with processes.together():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        shown = progress and accelerator.is_main_process
        with text_stage("pretrain: tokenize pretrain.text", text, shown):
            ids = encode(tokenizer, text)
        if tokens is not None:
            tokens["text"] = ids
        with text_stage("pretrain: tokenize data.eval", eval_text, shown):
            eval_ids = encode(tokenizer, eval_text)
        model = build_model(section, len(tokenizer), tokenizer.eos_token_id, seed)
        model.to(parse_dtype(section.dtype))
        try:
            batches = RandomWindows(ids, section.seq_len, section.batch_size, seed)
        except NormswapError as e:
            raise NormswapError(f"pretrain.text: {e}") from None
    history = train(accelerator, model, section, batches, partial / "state", stop=stop, progress=progress,
                    desc="pretrain", log_prefix="pretrain/")
    info = {}
    with processes.together():
        if accelerator.is_main_process:
            from normswap.evaluate import perplexity

            # Seconds to a minute on a CPU (every held-out token): a bar, as every long stage has.
            with ProgressBars({"perplexity": "tok"}, labels={"perplexity": "pretrain: held-out perplexity"}) as bars:
                with using_option_names(_HELDOUT_NAMES):
                    ppl = perplexity(model, tokenizer, eval_ids, progress=bars if progress else False,
                                     **_heldout_windows(section))
            info = {
                "steps": history.step, "train_seconds": round(history.train_seconds, 1),
                "train_tokens": ids.numel(), "tokens_seen": history.step * section.batch_size * section.seq_len
                * section.grad_accum * accelerator.num_processes,
                "parameters": sum(p.numel() for p in model.parameters()),
                "final_train_loss": history.losses[-1] if history.losses else None,
                "heldout_tokens": eval_ids.numel(), "heldout_ppl": ppl.ppl,
                "unigram_ppl": unigram_perplexity(ids, eval_ids, len(tokenizer)),
                "section": dataclasses.asdict(section), "seed": seed,
            }
            if not ppl.ppl < info["unigram_ppl"]:
                # Kept (a tiny test model may not), but said loudly: the experiment's premise is a trained model.
                warnings.warn(f"pretraining did not beat the unigram baseline (held-out perplexity {ppl.ppl:.1f} "
                              f"vs {info['unigram_ppl']:.1f}): more steps or another learning rate", stacklevel=2)
            with _using_cache_entry_names(), staged_dir(final, replace=True) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                (tmp / INFO_FILE).write_text(json.dumps(info, indent=1))
            shutil.rmtree(partial, ignore_errors=True)
    if not accelerator.is_main_process:
        info = _read_info(final)
    return final, info


def _using_cache_entry_names():
    """The option names while the cache entry is published: the entry is not OUT, and what
    staged_dir refuses to replace there the experiment's force does not replace either (its
    message said "even with --force", pointing at a flag that does nothing for it)."""
    return using_option_names({"force": ""})


def _read_info(final: Path) -> dict:
    """The INFO_FILE of a cached pretraining, refused as bad input when it is not what we wrote."""
    remedy = f"delete {final} to pretrain again"
    info = jsonsafe.read_or_refuse(final / INFO_FILE, remedy)
    if not isinstance(info, dict):
        raise NormswapError(f"{final / INFO_FILE}: not a pretraining record (a JSON object); {remedy}")
    return info
