"""Who reads each norm's output, found by running the model once rather than from per-model tables.

The model's forward runs once on a tiny input (on the meta device for scans: shapes only, no
arithmetic, any model size). Forward hooks remember each norm's output tensor and keep a stack of
the modules currently executing; a dispatch mode sees every tensor operation. An operation that
reads a norm's output (or a view, copy or cast of it) is charged to the module on top of the stack:
the module whose own code did the reading. So a decoder layer that merely hands the tensor to its
attention is not a consumer, its q/k/v projections are; a layer that adds the norm's output to the
residual stream (Gemma 2's post-norms, BLOOM's embedding norm) is.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SEQ_LEN = 4

# Operations that pass a value on unchanged (up to dtype): their outputs are still "the norm's
# output", and running them is not a use. Views are recognised from the op's schema.
_PASS_THROUGH = {"clone", "alias", "detach", "_to_copy", "lift_fresh", "contiguous", "dropout",
                 "native_dropout", "_unsafe_view", "view", "reshape", "expand", "t", "transpose"}


def tensors_in(obj) -> Iterable[torch.Tensor]:
    """Every tensor in a nest of lists, tuples, dicts and transformers ModelOutputs."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
    elif hasattr(obj, "to_tuple"):  # a ModelOutput that is not a dict subclass
        yield from tensors_in(obj.to_tuple())


class _Tracer(TorchDispatchMode):
    """Charges each op on a tracked tensor to the module on top of the stack.

    It also answers the value questions a forward asks of meta tensors (.item(), `if mask.all()`):
    transformers inspects ids, masks and positions to pick fast paths (padding? packed sequences?),
    and meta tensors hold no values. The answers (True, 1.0, the sequence length) pick the plain
    causal path; they steer only those checks, never which module reads which tensor.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every __torch_dispatch__ in a dynamo-disable guard, which costs more than
        # the rest of a meta forward; nothing is compiled during a scan, so go without it.
        return False

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.tracked: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> (norm path, tensor)
        self.consumers: dict[str, set[str]] = {}

    def track(self, tensor: torch.Tensor, norm: str) -> None:
        self.tracked[id(tensor)] = (norm, tensor)  # the reference keeps the id from being reused

    def norm_of(self, tensor: torch.Tensor) -> str | None:
        hit = self.tracked.get(id(tensor))
        return hit[0] if hit is not None and hit[1] is tensor else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args and args[0].is_meta:
            t = args[0]
            if t.dtype == torch.bool:
                return True
            return 1.0 if t.dtype.is_floating_point else SEQ_LEN
        out = func(*args, **kwargs)
        norms = {n for t in tensors_in((args, kwargs)) if (n := self.norm_of(t)) is not None}
        if norms:
            name = func.overloadpacket.__name__
            if name in _PASS_THROUGH or getattr(func, "is_view", False):
                for t in tensors_in(out):
                    for n in norms:
                        self.track(t, n)
            elif self.stack:
                for n in norms:
                    self.consumers.setdefault(n, set()).add(self.stack[-1])
        return out


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def dummy_inputs(model: nn.Module) -> dict:
    """input_ids (and decoder_input_ids for encoder-decoders) on the model's device."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    ids = torch.ones((1, SEQ_LEN), dtype=torch.long, device=device)
    inputs = {"input_ids": ids}
    config = getattr(model, "config", None)
    params = _forward_params(model)
    if "attention_mask" in params:
        # Explicit, so that no model warns that the dummy ids (1, a common pad id) may be padding.
        inputs["attention_mask"] = torch.ones_like(ids)
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def module_order_key(path: str):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split(".")]


def find_consumers(model: nn.Module, norm_paths: list[str],
                   inputs: dict | None = None) -> tuple[dict[str, list[str]] | None, str | None]:
    """({norm path: [consumer module paths]}, None), or (None, a note saying why not)."""
    wanted = set(norm_paths)
    tracer = _Tracer()
    handles = []

    def push(path):
        def hook(_module, _args):
            tracer.stack.append(path)
        return hook

    def pop(path):
        def hook(_module, _args, output):
            tracer.stack.pop()
            if path in wanted:
                for t in tensors_in(output):
                    tracer.track(t, path)
        return hook

    was_training = model.training
    model.eval()  # dropout in training mode would read (mask) every tensor it passes on
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(push(path)))
            handles.append(module.register_forward_hook(pop(path)))
        try:
            with torch.no_grad(), tracer:
                model(**(inputs if inputs is not None else dummy_inputs(model)))
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:120]
            return None, (f"consumers unknown: the model's forward did not run on a dummy input "
                          f"({e.__class__.__name__}: {first})")
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    result = {}
    for norm in norm_paths:
        result[norm] = sorted((p for p in tracer.consumers.get(norm, ()) if p != norm), key=module_order_key)
    return result, None
