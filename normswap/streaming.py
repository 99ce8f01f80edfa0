"""Shard-by-shard conversion of a safetensors checkpoint.

Only the tensors of the job being folded are in memory at once: they are read with safetensors'
lazy `safe_open`, transformed (normswap.jobs.run_job), and written straight to their place in
the output file. The output files' headers are written first (every tensor's dtype and shape is
known before any data is read), so each tensor lands at its final offset with one seek + write
and no shard is ever assembled in memory. Peak memory is therefore the largest job (typically the
lm_head or embedding table), not the model.

The in-memory path (streaming=False) loads every tensor first and runs the same jobs through the
same writer, so both paths write byte-identical files; tests hold them to that.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from normswap import jsonsafe
from normswap.errors import NormswapError, one_line
from normswap.jobs import keep_dtype, run_job
from normswap.plan import Plan
from normswap.progress import ProgressFn

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The model weights (and their indexes) in the names transformers saves and loads them under.
STOCK_WEIGHTS = re.compile(r"(model|pytorch_model|tf_model|flax_model)(-\d+-of-\d+)?"
                           r"\.(safetensors|bin|h5|msgpack)(\.index\.json)?")

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def read_header(path: Path) -> dict:
    """A safetensors file's JSON header (names, dtypes, shapes, offsets), without reading data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise NormswapError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise NormswapError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = jsonsafe.loads(f.read(n))
        except ValueError as e:
            raise NormswapError(f"{path}: not a safetensors file (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise NormswapError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header


def checkpoint_layout(src: Path) -> tuple[list[str], dict[str, str], bool]:
    """(shard file names in order, key -> file name, sharded?) for a safetensors checkpoint dir.
    A model.safetensors beside an index is what transformers loads (it looks for the single file
    first), so it is what is read here too: the conversion must fold the weights the verification
    and every later load see."""
    index = src / INDEX_NAME
    single = src / SINGLE_NAME
    if index.is_file() and not single.is_file():
        try:
            weight_map = jsonsafe.read_or_refuse(index, what="index")["weight_map"]
        except (KeyError, TypeError):
            raise NormswapError(f"{index}: malformed index (no weight_map)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise NormswapError(f"{index}: malformed index (weight_map must map tensor names to shard file names)")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:  # said here: a missing shard would otherwise surface as a failed write
            raise NormswapError(f"{index}: names {len(missing)} shard(s) that are not there (e.g. {missing[0]})")
        return files, dict(weight_map), True
    if single.is_file():
        keys = [k for k in read_header(single) if k != "__metadata__"]
        return [SINGLE_NAME], {k: SINGLE_NAME for k in keys}, False
    raise NormswapError(f"{src}: no {SINGLE_NAME} or {INDEX_NAME} (streaming needs safetensors)")


class CheckpointReader:
    """Lazy access to a checkpoint's tensors under the model's own parameter names.

    Checkpoints saved from a bare base model (GPT-2 on the hub: "h.0.attn...") lack the
    *ForCausalLM prefix; names are mapped to the model's names ("transformer.h.0.attn...").
    Each read opens the shard with safe_open and returns that one tensor, lazily mapped.
    """

    def __init__(self, src: Path, model_names: Iterable[str], prefix: str = "", aliases: dict | None = None):
        self.src = Path(src)
        self.files, raw_map, self.sharded = checkpoint_layout(self.src)
        names = set(model_names)
        pre = prefix + "." if prefix else ""
        self.raw: dict[str, tuple[str, str]] = {}  # canonical -> (file, key in file)
        for key, file in raw_map.items():
            canonical = key if (key in names or not pre or pre + key not in names) else pre + key
            self.raw[canonical] = (file, key)
        self.aliases = dict(aliases or {})
        self._headers: dict[str, dict] = {}

    def header(self, file: str) -> dict:
        if file not in self._headers:
            self._headers[file] = read_header(self.src / file)
        return self._headers[file]

    def _locate(self, name: str) -> tuple[str, str]:
        if name in self.raw:
            return self.raw[name]
        if name in self.aliases and self.aliases[name] in self.raw:
            return self.raw[self.aliases[name]]
        raise NormswapError(f"{self.src}: the checkpoint has no tensor {name}")

    def meta(self, name: str) -> tuple[torch.dtype, list[int]]:
        file, key = self._locate(name)
        h = self.header(file).get(key)
        if h is None:  # an index that names the wrong shard for this tensor
            raise NormswapError(f"{self.src / INDEX_NAME}: names {file} for {key}, which that file does not hold")
        if not (isinstance(h, dict) and isinstance(h.get("shape"), list)):
            raise NormswapError(f"{self.src / file}: not a safetensors file (malformed header entry {key})")
        if h.get("dtype") not in ST_DTYPES:
            raise NormswapError(f"{name}: unsupported safetensors dtype {h.get('dtype')}")
        return ST_DTYPES[h["dtype"]], list(h["shape"])

    def file_of(self, name: str) -> str:
        return self._locate(name)[0]

    def read(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        file, key = self._locate(name)
        try:
            with safe_open(self.src / file, framework="pt") as f:
                # A lazily mapped view of the file: its pages are read when touched and released
                # when the tensor is freed, so nothing of the shard outlives the job that asked.
                return f.get_tensor(key)
        except (SafetensorError, OSError) as e:  # a truncated or corrupt shard is bad input
            msg = one_line(e)
            raise NormswapError(f"{self.src / file}: unreadable safetensors file ({msg})") from None

    def names(self) -> list[str]:
        return list(self.raw)


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is known up front, tensor by tensor, in any
    order. The header (format: 8-byte little-endian length, JSON, space padding to 8 bytes) is
    written at once; each tensor then goes to its offset."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, list[int]]], metadata: dict):
        self.path = Path(path)
        header: dict = {"__metadata__": metadata}
        self.slots: dict[str, tuple[int, int, torch.dtype, list[int]]] = {}
        offset = 0
        for name, dtype, shape in sorted(entries, key=lambda e: e[0]):
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.slots[name] = (offset, n, dtype, list(shape))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.base = 8 + len(blob)
        self.size = self.base + offset
        self.written: set[str] = set()
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.f.truncate(self.size)

    def write(self, name: str, t: torch.Tensor) -> None:
        start, n, dtype, shape = self.slots[name]
        if t.dtype != dtype or list(t.shape) != shape:
            raise NormswapError(f"{name}: expected {dtype} {shape}, got {t.dtype} {list(t.shape)}")
        if name in self.written:
            raise NormswapError(f"{name} written twice")
        if n:
            self.f.seek(self.base + start)
            # write from the tensor's own buffer (no bytes copy of a possibly large tensor)
            self.f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.written.add(name)

    def close(self) -> None:
        missing = set(self.slots) - self.written
        self.f.close()
        if missing:
            raise NormswapError(f"{self.path.name}: {len(missing)} tensors never written (e.g. {sorted(missing)[0]})")


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def convert_files(
    src: Path,
    out: Path,
    plan: Plan,
    model_names: Iterable[str],
    prefix: str = "",
    out_dtype: Callable[[str, torch.Tensor], torch.dtype] | None = None,
    streaming: bool = True,
    progress: bool | ProgressFn = False,
    dropped: Iterable[str] = (),
) -> dict[str, dict]:
    """Convert the safetensors checkpoint in `src` into `out` (same shard files, same tensor names
    plus an untied head, less the tensors `dropped` names, as the checkpoint stores them; a shard
    left with none is not written); returns the jobs' infos (e.g. BLOOM's bake scale)."""
    policy = out_dtype or keep_dtype(None)
    reader = CheckpointReader(Path(src), model_names, prefix, plan.aliases)
    dropped = set(dropped)
    for name, (_, key) in list(reader.raw.items()):
        if key in dropped:
            del reader.raw[name]
    job_outputs = {o for j in plan.jobs for o in j.outputs}
    new_names = [o for o in job_outputs if o not in reader.raw]  # the untied head

    # Every output tensor: its file, dtype and shape, known before any data is read.
    placement: dict[str, str] = {}
    entries: dict[str, list] = {f: [] for f in reader.files}
    for name in reader.names():
        placement[name] = reader.file_of(name)
    for name in new_names:
        placement[name] = reader.file_of(name)  # beside the table it was tied to
    for name, file in placement.items():
        dtype, shape = reader.meta(name)
        entries[file].append((name, policy(name, torch.empty(0, dtype=dtype)), shape))
    writers = {f: SafetensorsWriter(Path(out) / f, entries[f], {"format": "pt"}) for f in reader.files if entries[f]}

    total = sum(_nbytes(d, s) for es in entries.values() for _, d, s in es)
    bar = _progress(total, progress)
    infos: dict[str, dict] = {}
    try:
        if streaming:
            read = reader.read
        else:
            everything = {n: reader.read(n) for n in reader.names()}

            def read(name: str) -> torch.Tensor:
                return everything[name if name in everything else plan.aliases[name]]

        for job in plan.jobs:
            tensors, info = run_job(job, read, policy)
            if info:
                infos[job.module] = info
            for name, t in tensors.items():
                writers[placement[name]].write(name, t)
                bar.update(t.numel() * t.element_size())
            del tensors
        for name in reader.names():
            if name in job_outputs:
                continue
            t = read(name)
            t = t.to(policy(name, t))
            writers[placement[name]].write(name, t)
            bar.update(t.numel() * t.element_size())
            del t
    finally:
        for w in writers.values():
            if not w.f.closed:
                w.f.close()
        bar.close()
    for w in writers.values():
        w.close()
    if reader.sharded:
        weight_map = {n: placement[n] for n in sorted(placement)}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (Path(out) / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return infos


def _progress(total: int, progress):
    from normswap.progress import bar

    return bar(progress, "convert", total, unit="B", unit_scale=True)
