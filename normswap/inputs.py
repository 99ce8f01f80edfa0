"""The inputs of one forward of a model, derived from its forward's signature and its config.

A text model reads token ids; a vision model `pixel_values` (a video model a clip of them), an
audio model `input_features` (a spectrogram) or `input_values` (a waveform, or AST's spectrogram).
Which of them a model takes is read from its
`main_input_name` and its forward's parameters; their shapes from its config (and its sub-configs:
a CLIP model's image size is in its vision_config) and from its module tree (the strides of the
convolutions that turn a spectrogram or a waveform into positions). Nothing here names a model.

Two users: discovery traces one forward on the meta device (normswap.discover: values do not
matter there, shapes do), and the whole-model checks run one on a probe batch of random values
(normswap.verify.probe_batch). Both go through `build`, so both feed the same inputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

# The inputs this module can build, beyond token ids: what a vision or audio forward reads.
MODALITY_INPUTS = ("pixel_values", "input_features", "input_values")
# Inputs of another modality that are not built here (their shapes follow from a processor, not
# the config): a forward that takes one is traced without it, and says so (normswap.discover).
UNBUILT_INPUTS = ("pixel_values_videos", "image_patches", "input_audio_embeds", "audio_values")

IMAGE_SIZE = 224  # a config that names no image size: the common default of vision towers
LOW_ID = 3  # random ids start here: above the usual special ids (pad, bos, eos)


def forward_params(fn: Callable) -> list[str]:
    """The parameter names of a forward (or any method), in order; [] when not inspectable."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def takes(fn: Callable, name: str) -> bool:
    """Whether `fn` accepts the keyword `name`: it names it, or takes **kwargs (where transformers'
    forwards take output_hidden_states); False when not inspectable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def _configs(config):
    """`config`, then its sub-configs (text, vision, audio, encoder...), breadth first: a
    setting of the model's own config wins over a sub-config's, a child's over a grandchild's."""
    seen: set[int] = set()
    todo = [config]
    while todo:
        c = todo.pop(0)
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]


def setting(config, *names: str):
    """The first of `names` that `config` or one of its sub-configs sets (not None), else None."""
    for c in _configs(config):
        for name in names:
            value = getattr(c, name, None)
            if value is not None:
                return value
    return None


def text_config(config):
    """The config of the model's token side: a multimodal model's text config, else the config
    itself. Where transformers finds two (MusicGen's text encoder and decoder: get_text_config()
    refuses to choose), the encoder's, the one `input_ids` reach."""
    get_text = getattr(config, "get_text_config", None)
    if not callable(get_text):
        return config
    try:
        return get_text()
    except ValueError:
        return get_text(encoder=True)


def decoder_config(config):
    """The config of an encoder-decoder's decoder side, which its decoder_input_ids index: the
    config itself for most (T5, BART, Whisper share one vocabulary), the decoder's own where it
    has one (MusicGen's decoder reads audio codes of its own vocabulary, not its text encoder's)."""
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            return get_text(decoder=True)
        except (TypeError, ValueError):
            pass
    return config


def codebooks(config, model: nn.Module) -> int:
    """How many rows of ids make one sequence for a model of `config`: its num_codebooks where it
    reads several parallel streams of codes per position (MusicGen's decoder takes them as
    (batch x num_codebooks, length) rows), else 1. A config's num_codebooks alone does not say so:
    CSM, Moshi and Higgs Audio set one and read (batch, length) text ids (their codes come another
    way); a model that looks each row up in a table of its own, one table per codebook (a list
    of num_codebooks Embeddings), reads them as rows."""
    n = getattr(config, "num_codebooks", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return 1
    per_codebook = any(isinstance(m, nn.ModuleList) and len(m) == n and all(isinstance(e, nn.Embedding) for e in m)
                       for m in model.modules())
    return n if per_codebook else 1


def _token_setting(config, *names: str) -> int | None:
    """The first of `names` set to a positive whole number in the text config, else in the
    config, else in a sub-config (breadth first); None when none is. The token side goes first:
    a multimodal model's own config may hold a value of its other modality under the same name
    (VibeVoice-ASR's max_position_embeddings counts audio frames; MusicFlamingo's is a float)."""
    for c in (text_config(config), config, *_configs(config)):
        for name in names:
            value = getattr(c, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def vocab_size(config) -> int:
    """The token vocabulary (as _token_setting finds it); 0 if none."""
    return _token_setting(config, "vocab_size") or 0


# Config attributes that hold a model's context length, by the names the families use (MPT's
# max_seq_len sizes its ALiBi table: a longer input fails in the forward).
CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length",
                 "max_seq_len")


def context_length(config) -> int | None:
    """Positions the model's token ids can take (its context), from the config alone, as
    _token_setting finds it; None when no config names one. The one reading of it: the probe
    batch's length (normswap.verify), the perplexity window, bench's and experiment's checks.

    A model built of two configs, an encoder's and a decoder's (EncoderDecoderConfig: a BERT
    encoder, a GPT-2 decoder; MusicGen's text encoder and decoder), has two position tables: the
    inputs of `build`'s seq_len reach the encoder, and the decoder's ids are no longer. Its
    context is the smaller of the two that are named (a vision or audio encoder names none under
    CONTEXT_ATTRS, nor does T5's relative attention). Read from the decoder only (the text config
    transformers gives), a 6-position BERT encoder under a 64-position GPT-2 was fed a probe of 8
    ids, and `patch` failed in its forward."""
    decoder = getattr(config, "decoder", None)
    encoder = getattr(config, "encoder", None) or getattr(config, "text_encoder", None)
    if not all(hasattr(c, "to_dict") and hasattr(c, "model_type") for c in (encoder, decoder)):
        return _token_setting(config, *CONTEXT_ATTRS)
    named = [n for n in (_token_setting(c, *CONTEXT_ATTRS) for c in (encoder, decoder)) if n is not None]
    return min(named) if named else _token_setting(config, *CONTEXT_ATTRS)


def main_input(model: nn.Module, fn: Callable | None = None) -> str | None:
    """The input `fn` (the model's forward) is mainly about: the model's main_input_name when the
    forward takes it, else the forward's first parameter that can be built (a vision tower whose
    class keeps the default main_input_name "input_ids" but reads pixel_values)."""
    params = forward_params(fn or model.forward)
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):
        main = main[0] if main else "input_ids"
    if main in params:
        return main
    return next((p for p in params if p in ("input_ids", *MODALITY_INPUTS)), None)


def candidates(model: nn.Module) -> list[tuple[str, ...]]:
    """The input sets to try, in order, for one forward: the main input with every other modality
    input the forward takes that can be built, then (when there were others) the main input
    alone. A model that pairs token ids with images (CLIP, GIT) runs on both; a multimodal LM whose
    images need placeholder tokens in the ids (which no config says how to place) fails on both
    and runs on the ids alone."""
    params = forward_params(model.forward)
    main = main_input(model)
    if main is None:
        return []
    extra = [p for p in params if p in MODALITY_INPUTS and p != main]
    if extra:
        return [(main, *extra), (main,)]
    return [(main,)]


def unbuilt(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """The modality inputs `fn` takes that an input set `names` leaves out."""
    return [p for p in forward_params(fn) if p in (*MODALITY_INPUTS, *UNBUILT_INPUTS) and p not in names]


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _conv_stride(model: nn.Module) -> int:
    """The product of the strides of the model's 1-d convolutions: how many input steps make one
    position."""
    stride = 1
    for m in model.modules():
        if isinstance(m, nn.Conv1d):
            stride *= int(m.stride[0])
    return stride


def _samples(model: nn.Module, positions: int) -> int:
    """The fewest waveform samples the model's 1-d convolutions, applied in module order (a feature
    encoder's chain), turn into `positions` positions: each needs stride x (its outputs - 1) +
    its dilated kernel, less its zero padding. A padded convolution of stride 1 (wav2vec2's
    positional convolution, a conformer's depthwise one) keeps the length, so it adds nothing; an
    earlier count added every kernel's overhang, padded or not, and multiplied none by the strides
    before it: 2756 samples for wav2vec2-conformer's 8 positions, which 2640 make; 3140 for
    Moonshine's 8, which made 6."""
    n = positions
    for m in reversed([m for m in model.modules() if isinstance(m, nn.Conv1d)]):
        stride, kernel, dilation = int(m.stride[0]), int(m.kernel_size[0]), int(m.dilation[0])
        pad = 0 if isinstance(m.padding, str) else int(m.padding[0])
        if m.padding == "same" or (stride == 1 and 2 * pad >= dilation * (kernel - 1)):
            continue
        n = max(stride * (n - 1) + dilation * (kernel - 1) + 1 - 2 * pad, 1)
    return n


def _image_size(config) -> tuple[int, int]:
    size = setting(config, "image_size", "img_size", "input_size")
    if isinstance(size, dict):
        size = (size.get("height"), size.get("width"))
    if isinstance(size, (list, tuple)):
        size = [s for s in size if isinstance(s, int)][-2:]
        if len(size) == 2:
            return size[0], size[1]
        size = size[0] if size else None
    return (size, size) if isinstance(size, int) and size > 0 else (IMAGE_SIZE, IMAGE_SIZE)


def _features_shape(model: nn.Module, config, batch: int, seq_len: int) -> tuple[int, ...]:
    """A spectrogram: (batch, mel bins, frames) where the config counts mel bins (Whisper and the
    audio towers built like it, which take exactly max_source_positions frames per position after
    their strided convolutions), else (batch, frames, features) of seq_len positions (a conformer's
    max_source_positions bounds its relative positions, 5000 frames of attention in a probe)."""
    stride = _conv_stride(model)
    mels = setting(config, "num_mel_bins")
    if isinstance(mels, int):
        positions = setting(config, "max_source_positions")
        return (batch, mels, (positions if isinstance(positions, int) and positions > 0 else seq_len) * stride)
    frames = seq_len * stride
    per_channel = setting(config, "input_feat_per_channel")
    if isinstance(per_channel, int):
        return (batch, frames, per_channel * (setting(config, "input_channels") or 1))
    size = setting(config, "feature_projection_input_dim", "feature_size")
    return (batch, frames, size if isinstance(size, int) else 80)  # 80: the usual speech front end's mel bins


def _values_shape(model: nn.Module, config, batch: int, seq_len: int) -> tuple[int, ...]:
    """A waveform (batch, samples) long enough for seq_len positions after the 1-d convolutions
    that turn samples into positions. A model with none whose config counts mel bins reads a
    spectrogram there (AST: batch, frames, mel bins), of the config's max_length frames (which
    its position table is built for) where it sets one, else of seq_len."""
    mels = setting(config, "num_mel_bins")
    if isinstance(mels, int) and mels > 0 and not any(isinstance(m, nn.Conv1d) for m in model.modules()):
        frames = setting(config, "max_length")
        return (batch, frames if isinstance(frames, int) and frames > 0 else seq_len, mels)
    return (batch, _samples(model, seq_len))


def build(model: nn.Module, names: tuple[str, ...], fn: Callable | None = None, *, batch: int = 1,
          seq_len: int = 4, decoder_len: int | None = None, generator: torch.Generator | None = None,
          device=None, masks: bool = True) -> dict:
    """Keyword arguments for `fn` (the model's forward, or one of its methods) holding the inputs
    `names`: values drawn from `generator` (ids in [LOW_ID, vocab), floats normal), or, without
    one, ones (shapes are all a meta-device trace needs). seq_len counts tokens, or positions of
    an audio input; an encoder-decoder gets decoder_input_ids of decoder_len (seq_len) tokens, and
    a spectrogram the all-ones mask of its frames where the forward takes one. masks: an all-ones
    attention_mask with token ids, and use_cache=False, where the forward takes them."""
    config = getattr(model, "config", None)
    params = set(forward_params(fn or model.forward))
    if device is None:  # a meta model's (a parameter a legacy constructor made on the CPU aside)
        devices = [p.device for p in model.parameters()]
        device = torch.device("meta") if any(d.type == "meta" for d in devices) else \
            devices[0] if devices else torch.device("cpu")
    fdtype = _float_dtype(model)

    def ids(n: int, side=None) -> torch.Tensor:
        # `side`: the config of the ids' own side (a decoder's, which may have its own vocabulary
        # and read several codebooks per position); the token side's by default
        rows = batch * codebooks(side if side is not None else text_config(config), model)
        if generator is None:
            return torch.ones((rows, n), dtype=torch.long, device=device)
        vocab = (_token_setting(side, "vocab_size") if side is not None else None) or vocab_size(config)
        return torch.randint(min(LOW_ID, vocab - 1), vocab, (rows, n), generator=generator).to(device)

    def floats(shape) -> torch.Tensor:
        if generator is None:
            return torch.ones(shape, dtype=fdtype, device=device)
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=fdtype)

    out: dict = {}
    for name in names:
        if name == "input_ids":
            out[name] = ids(seq_len)
            if masks and "attention_mask" in params:
                # Explicit, so that no model warns that the ids (1, a common pad id) may be padding.
                out["attention_mask"] = torch.ones_like(out[name])
        elif name == "pixel_values":
            channels = setting(config, "num_channels")
            image = (channels if isinstance(channels, int) else 3, *_image_size(config))
            # A config that counts frames is a video model's (VideoMAE, ViViT, TimeSformer): a clip
            # of exactly that many images, which its position table (or time embedding) is built for.
            frames = setting(config, "num_frames")
            out[name] = floats((batch, frames, *image) if isinstance(frames, int) and frames > 0 else (batch, *image))
        elif name == "input_features":
            shape = _features_shape(model, config, batch, seq_len)
            out[name] = floats(shape)
            if "input_features_mask" in params:
                frames = shape[2] if isinstance(setting(config, "num_mel_bins"), int) else shape[1]
                out["input_features_mask"] = torch.ones((batch, frames), dtype=torch.long, device=device)
        elif name == "input_values":
            out[name] = floats(_values_shape(model, config, batch, seq_len))
        else:
            raise ValueError(f"cannot build the input {name!r}")
    if getattr(config, "is_encoder_decoder", False):
        out["decoder_input_ids"] = ids(decoder_len or seq_len, decoder_config(config))
    if masks and "use_cache" in params:
        out["use_cache"] = False
    return out
