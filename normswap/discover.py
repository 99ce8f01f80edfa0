"""Where each norm's input comes from and where its output goes, found by running the model.

One forward on a tiny input (the meta device is enough: shapes only, no weights read) is traced
at the level of aten operations. Every tensor an operation makes is remembered with the operation
that made it and the module whose own code ran it (the module on top of a stack kept by forward
hooks), so the trace is a dataflow graph. The one trace serves two questions.

A norm's *readers* (norm_readers, for any norm: what `normswap scan` lists): the modules whose
own code reads the norm's output, followed through views, casts and pieces cut by position
(split, chunk, unbind: each piece is rows of the output). So a decoder layer that merely
hands the tensor to its attention is not a reader, its q/k/v projections are; a layer that adds the
norm's output to the residual stream (Gemma 2's post-norms, BLOOM's embedding norm) is; OUTPUT when
the output leaves the model as is, or a sum of its rows scaled by constants does (AST's pooler,
(y[:, 0] + y[:, 1]) / 2: nothing from outside the output enters it; a module reading such a sum
is its reader).

Whether a LayerNorm can become an RMSNorm exactly (discover, what `normswap convert` plans from),
for every LayerNorm-like module:

- its input is taken apart, back through adds, views, casts and scalings, into the *terms* it is
  a sum of: embedding lookups, the outputs of Linear / Conv1D writers, other norms' outputs, and
  anything else (a gated product, positions computed on the fly, a constant);
- its readers: a Linear / Conv1D can absorb γ and β (those of a converted norm are the layers
  it folds into), anything else cannot.

The conversion centers every term (an embedding table's rows, a writer's output rows and bias) and
folds γ/β into the readers, so it is exact only where every term can be centered, every reader
is linear, and nothing reads the stream without a mean-subtracting norm in front of it. Each norm
that fails one of these gets a refusal with a category (REFUSALS) and a reason naming the module
or operation responsible. Nothing here knows any architecture: normswap.plan turns the result
into jobs, and normswap/archs/*.toml can override it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from normswap import fold, registry
from normswap import inputs as model_inputs

# Refusal categories: why a LayerNorm cannot become an RMSNorm exactly.
REFUSALS = {
    "post-ln": "the norm's output is the residual stream itself, or its input holds another norm's output",
    "not-stream": "the norm reads a sublayer's value (q/k norms, a norm inside an MLP or head), not a sum of "
                  "writers that can be centered",
    "uncenterable-term": "a term of the norm's input is not an embedding lookup or a Linear output (a gated or "
                         "multiplicative term, positions computed on the fly, a constant)",
    "nonlinear-reader": "something other than a Linear/Conv1D reads the norm's output, so γ and β cannot be folded",
    "stray-reader": "the residual stream is read somewhere without a mean-subtracting norm in front of it, so "
                    "centering its writers would change that reader",
    "norm-form": "the module does not compute F.layer_norm over the last dimension with its own weight and bias "
                 "(1 + w gains, hand-written formulas), so the fold's algebra differs",
    "shared-weights": "a writer, reader or table is shared with another module, or a module runs more than once",
    "untraced": "the model's forward could not be traced on the meta device, or the norm never ran",
    "arch-data": "normswap/archs/<model_type>.toml refuses it, or does not describe this model",
}

OUTPUT = "<output>"  # the reader of a norm output that leaves the model as is (γ and β stay in the norm)
STREAM = "<residual stream>"  # a baked embedding norm's "reader"

# Operations that pass a value on unchanged (up to dtype or layout). Whether the hidden (last)
# dimension survives is checked per call (_keeps_rows).
_PASS = {"clone", "alias", "detach", "_to_copy", "lift_fresh", "contiguous", "dropout", "native_dropout",
         "_unsafe_view", "view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "t",
         "transpose", "permute", "index", "to", "type_as", "copy"}
# Operations that cut a value into pieces (torch.split, chunk, unbind). A cut that leaves the
# hidden dimension whole and last (_splits_rows) makes pieces of rows: each is read as the value
# is (ProphetNet chunks its stream by position before its relative-position projection).
_SPLIT = {"split", "split_with_sizes", "unbind"}
# Operations that move a dimension without touching values: followed back from a value whose last
# (hidden) dimension was another one's before (a patch embedding's channels, flattened and
# transposed to the last place), to the convolution whose output channels it was.
_MOVE = {"transpose", "permute", "view", "_unsafe_view", "reshape", "alias", "clone", "contiguous",
         "detach", "_to_copy"}
_ADD = {"add", "sub", "add_", "sub_"}
_SCALE = {"mul", "div", "mul_", "div_"}
# Operations that look at a tensor's shape, dtype or device only, never its values.
_SHAPE_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
               "new_full", "sym_size", "sym_numel", "sym_stride", "size", "stride", "is_same_size"}
_LAYER_NORM_OPS = {"native_layer_norm", "layer_norm"}


@dataclass
class _Node:
    op: str
    module: str
    ins: list  # per positional argument: a tensor key, a list of keys, or the plain value
    kw: dict
    outs: list  # tensor keys of the outputs, in order
    shapes_in: list
    shapes_out: list


@dataclass
class _Call:
    ins: list  # keys of the tensor positional arguments
    outs: list  # keys of the output tensors


def _key(t: torch.Tensor):
    return (id(t), t._version)


SEQ_LEN = 4


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


class _Recorder(TorchDispatchMode):
    """Records every aten operation as a _Node (see the module docstring).

    It also answers the value questions a forward asks of meta tensors (.item(), `if mask.all()`):
    transformers inspects ids, masks and positions to pick fast paths (padding? packed sequences?),
    and meta tensors hold no values. The answers (True, 1.0, the sequence length) pick the plain
    causal path; they steer only those checks, never which module reads which tensor.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every __torch_dispatch__ in a dynamo-disable guard, which costs more than
        # the rest of a meta forward; nothing is compiled during a trace, so go without it.
        return False

    def __init__(self):
        super().__init__()
        self.stack: list[str] = [""]
        self.nodes: list[_Node] = []
        self.producer: dict = {}
        self.users: dict = {}
        self.keep: list = []  # references that keep ids from being reused during the trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args and args[0].is_meta:
            t = args[0]  # a value question a forward asks of a meta tensor (see the class docstring)
            if t.dtype == torch.bool:
                return True
            return 1.0 if t.dtype.is_floating_point else SEQ_LEN
        ins = [self._keys(a) for a in args]
        shapes_in = [tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args]
        kw = {k: self._keys(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        outs = list(tensors_in(out))
        self.keep.append(outs)
        # An in-place op's version bump happens after this mode returns (ADInplaceOrView sits
        # above it), so the value it makes is keyed with the version the caller will see.
        written = {id(a) for a, s in zip(args, func._schema.arguments, strict=False)
                   if isinstance(a, torch.Tensor) and s.alias_info is not None and s.alias_info.is_write}
        # A view shares its base's version counter, but that sharing is also set up after this
        # mode returns: read here, a view of a parameter an init wrote in place would carry
        # version 0 and not match what its users see (a real model's stream bias, expanded).
        base = args[0] if args and isinstance(args[0], torch.Tensor) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns) else None
        out_keys = [(id(t), t._version + 1) if id(t) in written
                    else (id(t), base._version) if base is not None else _key(t) for t in outs]
        node = _Node(func.overloadpacket.__name__, self.stack[-1], ins, kw, out_keys,
                     shapes_in, [tuple(t.shape) for t in outs])
        i = len(self.nodes)
        self.nodes.append(node)
        for k in node.outs:
            self.producer[k] = i
        for k in _flat_keys(ins) + _flat_keys(list(kw.values())):
            self.users.setdefault(k, []).append(i)
        return out

    def _keys(self, a):
        if isinstance(a, torch.Tensor):
            self.keep.append(a)
            return _key(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return [self._keys(x) for x in a]
        return a


def _is_key(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], int)


def _flat_keys(items) -> list:
    out = []
    for x in items:
        if _is_key(x):
            out.append(x)
        elif isinstance(x, list):
            out += [k for k in x if _is_key(k)]
    return out


@dataclass
class Trace:
    nodes: list[_Node]
    producer: dict
    users: dict
    calls: dict[str, list[_Call]]
    params: dict  # key -> parameter names (several when tied)
    output_keys: set
    error: str | None = None
    via: str | None = None  # the method traced (a tower's get_image_features); None: the forward
    fed: tuple[str, ...] = ()  # the inputs it ran on (normswap.inputs names)
    unfed: list[str] = field(default_factory=list)  # modality inputs the forward takes and did not get
    more: list[Trace] = field(default_factory=list)  # traces of the towers the forward did not run


def trace(model: nn.Module, inputs: dict | None = None, towers: bool = True) -> Trace:
    """Run `model` once (meta device or real) and record its dataflow. Without `inputs`, on the
    first input set of normswap.inputs.candidates that the forward runs on (Trace.fed); then, for
    each modality input the forward takes and that run did not feed (a multimodal LM's images or
    audio, which need placeholder tokens in the ids that no config says how to place), the
    model's own get_<x>_features method (which runs that tower and its projector, as the forward
    does) on that input alone, or, where the model has none, the forward of the tower itself (the
    shallowest module whose forward is mainly about that input: Qwen2-Audio's audio_tower; asked
    for every hidden state, any of which its parent may read): the
    Trace's `more` (towers=False: not those)."""
    if inputs is not None:
        return _trace_call(model, model, inputs)
    sets = model_inputs.candidates(model) or [("input_ids",)]
    first = None
    for names in sets:
        tr = _trace_call(model, model, model_inputs.build(model, names, seq_len=SEQ_LEN))
        first = first or tr
        if tr.error is None:
            break
    else:
        names, tr = (), first  # the first set's failure says most: it holds every input
    tr.fed = names
    tr.unfed = model_inputs.unbuilt(model.forward, names)
    if tr.error is None and towers:
        for name in tr.unfed:
            found = _feature_method(model, name)
            if found is not None:
                owner, method = found
                fn = getattr(owner, method)
                # a tower's forward is called as the module, as its parent calls it (its hooks run)
                via = method if method != "forward" else next(p for p, m in model.named_modules() if m is owner)
                kwargs = model_inputs.build(owner, (name,), fn, seq_len=SEQ_LEN)
                if method == "forward" and model_inputs.takes(fn, "output_hidden_states"):
                    # The parent may read any layer's stream, not the last alone (LLaVA's
                    # vision_feature_layer): every hidden state leaves the traced call, so a
                    # norm is decided as if each were read (a get_<x>_features method returns
                    # what the model reads, and needs none of this).
                    kwargs["output_hidden_states"] = True
                sub = _trace_call(model, owner if method == "forward" else fn, kwargs, what=f"{via}({name})")
                sub.via, sub.fed = via, (name,)
                tr.more.append(sub)
    return tr


def _feature_method(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """(module, method): the shallowest get_<x>_features method in `model` that names the input
    `name` among its parameters (a wrapper taking *args defers to the one it calls); else
    (tower, "forward"): the shallowest module below the model whose forward is mainly about
    `name` (normswap.inputs.main_input: an inner multimodal model that also takes it is about its
    ids), the tower the forward would run on that input."""
    seen: set[type] = set()
    modules = list(model.named_modules())
    for _path, mod in modules:
        if type(mod) in seen:  # a model holds thousands of modules of a few classes
            continue
        seen.add(type(mod))
        for attr in sorted(dir(type(mod))):
            if attr.startswith("get_") and attr.endswith("_features") and callable(getattr(type(mod), attr, None)):
                if name in model_inputs.forward_params(getattr(mod, attr)):
                    return mod, attr
    towers = [(path.count("."), i, mod) for i, (path, mod) in enumerate(modules)
              if path and model_inputs.main_input(mod) == name]
    return (min(towers)[2], "forward") if towers else None



def _trace_call(model: nn.Module, fn, kwargs: dict, what: str = "forward") -> Trace:
    """Record the dataflow of fn(**kwargs) (the model, or one of its methods) over every module
    of `model`."""
    rec = _Recorder()
    calls: dict[str, list[_Call]] = {}
    handles = []

    def pre(path):
        def hook(_m, args, kwargs):
            rec.stack.append(path)
            keys = [_key(t) for t in tensors_in(list(args) + list(kwargs.values()))]
            calls.setdefault(path, []).append(_Call(keys, []))
        return hook

    def post(path):
        def hook(_m, _args, output):
            rec.stack.pop()
            outs = list(tensors_in(output))
            rec.keep.append(outs)
            calls[path][-1].outs = [_key(t) for t in outs]
        return hook

    params: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(_key(p), []).append(name)
    was_training = model.training
    model.eval()  # dropout in training mode would add a random mask op to every writer
    error = None
    output_keys: set = set()
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
            handles.append(module.register_forward_hook(post(path)))
        try:
            with torch.no_grad(), rec:
                out = fn(**kwargs)
            output_keys = {_key(t) for t in tensors_in(out)}
        except Exception as e:  # any model code may fail on meta tensors; say so per norm
            first = (str(e).strip().splitlines() or [""])[0][:120]
            error = f"the {what} did not run on a dummy input ({e.__class__.__name__}: {first})"
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return Trace(rec.nodes, rec.producer, rec.users, calls, params, output_keys, error)


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------


@dataclass
class Term:
    """One summand of a norm's input."""

    kind: str  # "writer" | "embedding" | "param" | "norm" | "other"
    ref: str  # module path (writer, norm, embedding module) or a description (other)
    key: tuple | None = None  # the term's tensor in the trace
    orientation: str | None = None  # writers


@dataclass
class NormFinding:
    """What discovery found for one LayerNorm-like module."""

    path: str
    eps: float | None = None
    hidden: int | None = None
    terms: list[Term] = field(default_factory=list)
    earlier: list[str] = field(default_factory=list)  # norms whose input is a partial sum of this one's
    readers: list[tuple[str, str | None]] = field(default_factory=list)  # (module | OUTPUT, orientation)
    baked_table: str | None = None  # an embedding norm whose output is the stream, baked into this table
    category: str | None = None
    reason: str | None = None

    def refuse(self, category: str, reason: str) -> None:
        assert category in REFUSALS, category
        if self.category is None:  # the first reason found is the one reported
            self.category, self.reason = category, reason


@dataclass
class Discovery:
    norms: dict[str, NormFinding]
    tables: list[str]  # embedding modules whose rows are centered
    writers: list[tuple[str, str]]  # (module, orientation) whose output rows and bias are centered
    untie: tuple[str, str] | None  # (head module, table module) tied and to be untied
    note: str | None = None  # a trace that failed
    params: list[str] = field(default_factory=list)  # parameters added into the stream as is


def is_layer_norm(mod: nn.Module) -> bool:
    """A LayerNorm-like module: the registry recognises it as a mean-subtracting norm, or (when
    it does not recognise it) its class is named like one. RMS norms named *LayerNorm (T5's
    family) are not."""
    if next(mod.children(), None) is not None or not registry.is_norm_like(mod):
        return False
    spec = registry.recognise(mod).spec
    if spec is not None:
        return spec.kind == "layer"
    name = type(mod).__name__.lower()
    return isinstance(mod, nn.LayerNorm) or ("layernorm" in name and "rms" not in name)


def layer_norm_paths(model: nn.Module) -> list[str]:
    """Paths of the LayerNorm-like modules of `model`, in module order."""
    return [p for p, m in model.named_modules() if is_layer_norm(m)]


def norm_readers(model: nn.Module, norm_paths: list[str],
                 tr: Trace | None = None) -> tuple[dict[str, list[str] | None] | None, str | None]:
    """({norm path: its readers}, a note or None), or (None, a note saying why they are unknown): for any
    norm (RMS or layer), the modules whose own code reads its output ("" for the model's own
    forward) in module order, after OUTPUT when the output (or a sum of its rows) leaves the model
    as is. A converted LayerNorm folds into exactly these (discover's NormFinding.readers). A norm
    the forward never ran but a tower's get_<x>_features did (Trace.more) has the readers seen there, OUTPUT written
    as `<output of get_x_features>` (the method's output goes on into the model, where the trace
    did not follow it). A norm no trace ran has readers None, and the note names it: nobody saw its
    output, which is not the same as nobody reading it. `tr`: a trace of `model` already made (the
    scan passes the one its conversion rows use)."""
    tr = tr if tr is not None else trace(model)
    if tr.error is not None:
        return None, f"readers unknown: {tr.error}"
    modules = dict(model.named_modules())
    readers: dict[str, list[str] | None] = dict.fromkeys(norm_paths)
    for t in (tr, *tr.more):
        if t.error is not None:
            continue
        analysis = _Analysis(model, modules, t)
        for p in norm_paths:
            if readers[p] is None and t.calls.get(p):
                found = analysis.readers_of(p)
                readers[p] = found if t.via is None else [r if r != OUTPUT else f"<output of {t.via}>" for r in found]
    never = [p for p, r in readers.items() if r is None]
    if not never:
        return readers, None
    more = f" (and {len(never) - 1} more)" if len(never) > 1 else ""
    failed = "; ".join(t.error for t in tr.more if t.error is not None)
    return readers, (f"readers unknown for {len(never)} norm{'s' * (len(never) > 1)} that the traced forward "
                     f"on a dummy input did not run: {never[0]}{more}" + (f" ({failed})" if failed else ""))


def discover(model: nn.Module, inputs: dict | None = None, tr: Trace | None = None) -> Discovery:
    """Trace `model` (any device; meta is the usual one) and decide, per LayerNorm, whether it can
    become an RMSNorm exactly and what must be centered and folded for it. A tower traced through
    its get_<x>_features method (Trace.more) is decided on that trace, alone: everything that
    leaves the method counts as leaving the model, and a module that runs in both is refused."""
    modules = dict(model.named_modules())
    tr = tr if tr is not None else trace(model, inputs)
    d = _Analysis(model, modules, tr).run()
    if tr.error is not None:
        return d
    if tr.unfed and any(f.category is None for f in d.norms.values()):
        # What the other modality adds into the residual stream (image features written over
        # placeholder tokens, patches concatenated before the text) was never seen, so it would
        # stay uncentered while the norms reading the stream run as RMS norms.
        why = (f"the forward also takes {', '.join(tr.unfed)}, which the traced forward could not feed: "
               "what that input adds into the residual stream was not seen")
        for f in d.norms.values():
            f.refuse("untraced", why)
        d.tables, d.writers, d.untie, d.params = [], [], None, []
    ran = {p: [t] for p in modules for t in (tr,) if t.calls.get(p)}
    for t in tr.more:
        for p in modules:
            if t.calls.get(p):
                ran.setdefault(p, []).append(t)
    for t in tr.more:
        never = {p for p, f in d.norms.items() if not tr.calls.get(p) and t.calls.get(p)}
        if t.error is not None:
            for p, f in d.norms.items():
                if not tr.calls.get(p) and f.category == "untraced":
                    f.reason += f"; {t.error}"
            continue
        if not never:
            continue
        elsewhere = {p for p, ts in ran.items() if any(o is not t for o in ts)}
        sub = _Analysis(model, modules, t, elsewhere).run()
        for p in never:
            d.norms[p] = sub.norms[p]
        d.tables += [m for m in sub.tables if m not in d.tables]
        d.writers += [w for w in sub.writers if w not in d.writers]
        d.params += [q for q in sub.params if q not in d.params]
    untowered = [n for n in tr.unfed if n in model_inputs.MODALITY_INPUTS and not any(n in t.fed for t in tr.more)]
    if untowered:
        for p, f in d.norms.items():
            if f.category == "untraced" and not any(t.calls.get(p) for t in (tr, *tr.more)):
                f.reason += (f"; the forward also takes {', '.join(untowered)}, and neither a get_<x>_features "
                             "method nor a tower's own forward runs on that input alone")
    return d


class _Analysis:
    def __init__(self, model, modules, tr: Trace, elsewhere: set | frozenset = frozenset()):
        self.model, self.modules, self.tr = model, modules, tr
        # Modules that also run in another trace of the model (discover: a tower's and the
        # forward's): nothing this trace converts may touch them, since it sees only its own run.
        self.elsewhere = elsewhere
        # Module path -> its index in module order, made once: readers_of runs once per norm, and
        # rebuilding it there was quadratic in the depth of the model.
        self.order: dict[str, int] = {q: j for j, q in enumerate(modules)}
        self.nodes = tr.nodes
        # Modules whose own code ran a layer-norm operation: norms by behaviour, not by name.
        self.ln_ops: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            if n.op in _LAYER_NORM_OPS:
                self.ln_ops.setdefault(n.module, []).append(i)
        paths = set(layer_norm_paths(model))
        self.norm_paths = sorted(paths, key=self.order.get)
        # Output tensor -> module, for the module kinds a term can be.
        self.out_of: dict = {}
        for path, calls in tr.calls.items():
            mod = modules.get(path)
            if mod is None or not calls:
                continue
            if fold_orientation(mod) is not None or path in paths or isinstance(mod, nn.Embedding) \
                    or _centerable_conv(mod):
                for c in calls:
                    for k in c.outs[:1]:
                        self.out_of.setdefault(k, path)
        self.memo: dict = {}

    # -- shapes and simple predicates ---------------------------------------------------------

    def shape(self, key):
        i = self.tr.producer.get(key)
        if i is None:
            return None
        n = self.nodes[i]
        return n.shapes_out[n.outs.index(key)]

    def _keeps_rows(self, n: _Node) -> bool:
        """A pass-through call that keeps the hidden dimension whole and last."""
        src = n.shapes_in[0] if n.shapes_in else None
        if src is None or not n.shapes_out:
            return False
        out = n.shapes_out[0]
        if not src or not out or src[-1] != out[-1]:
            return False
        nd = len(src)
        if n.op == "transpose":
            dims = [d % nd for d in n.ins[1:3] if isinstance(d, int)]
            return (nd - 1) not in dims
        if n.op == "t":
            return nd < 2
        if n.op == "permute":
            perm = n.ins[1] if len(n.ins) > 1 else None
            return isinstance(perm, (list, tuple)) and perm and perm[-1] % nd == nd - 1
        if n.op == "index":
            idx = n.ins[1] if len(n.ins) > 1 else []
            return isinstance(idx, list) and len(idx) < nd
        if n.op in ("slice", "select", "squeeze", "unsqueeze"):
            return True  # same last size: the hidden dimension was not cut
        return True

    @staticmethod
    def _splits_rows(n: _Node) -> bool:
        """A split, chunk or unbind across a dimension other than the last: every piece is rows."""
        src = n.shapes_in[0] if n.shapes_in else None
        if n.op not in _SPLIT or not src or not n.shapes_out:
            return False
        slot = 1 if n.op == "unbind" else 2  # split(self, size, dim=0), unbind(self, dim=0)
        dim = n.kw.get("dim", n.ins[slot] if len(n.ins) > slot else 0)
        return isinstance(dim, int) and dim % len(src) != len(src) - 1 and all(
            out and out[-1] == src[-1] for out in n.shapes_out)

    def pass_input(self, n: _Node):
        """The tensor a pass-through node passes on (None when it is not one)."""
        if n.op in _PASS and n.ins and _is_key(n.ins[0]) and self._keeps_rows(n):
            return n.ins[0]
        if n.op == "copy" and len(n.ins) > 1 and _is_key(n.ins[1]):  # copy_(dst, src): src's value
            return n.ins[1]
        return None

    @staticmethod
    def _per_row(shape, hidden) -> bool:
        """A multiplier constant across the hidden dimension (a scalar, or size 1 there)."""
        return shape is None or len(shape) == 0 or shape[-1] == 1

    # -- backward: the terms of a value ---------------------------------------------------------

    def terms(self, key, hidden: int, visited: set, adds: list) -> list[Term]:
        """The summands of the value `key` (hidden = the size of the normalised dimension)."""
        if key in self.out_of:
            path = self.out_of[key]
            mod = self.modules[path]
            if path in self.norm_set or "norm" in type(mod).__name__.lower():
                return [Term("norm", path, key)]
            o = fold_orientation(mod)
            if o is not None:
                return [Term("writer", path, key, o)]
        if key in self.tr.params:
            names = self.tr.params[key]
            shape = self._param_shape(key)
            if len(names) == 1 and shape and shape[-1] == hidden:  # a bias vector added as is: centered
                return [Term("param", names[0], key)]
            return [Term("other", f"the parameter {names[0]} added as is", key)]
        i = self.tr.producer.get(key)
        if i is None:
            return [Term("other", "a tensor made outside the traced forward", key)]
        n = self.nodes[i]
        visited.add(key)
        src = self.pass_input(n)
        if src is None and self._splits_rows(n) and _is_key(n.ins[0]):
            src = n.ins[0]  # a piece of rows: its terms are the whole's
        if src is not None:
            return self.terms(src, hidden, visited, adds)
        if n.op in _ADD:
            args = [a for a in n.ins[:2]]
            keys = [a for a in args if _is_key(a)]
            if len(keys) < 2:
                return [Term("other", f"a constant added ({n.op} in {n.module or '<model>'})", key)]
            out: list[Term] = []
            adds.append(key)
            for a in keys:
                s = self.shape(a) or self._param_shape(a)
                if s is not None and (len(s) == 0 or s[-1] != hidden):
                    out.append(Term("other", f"a value constant across the hidden dimension added "
                                             f"({n.op} in {n.module or '<model>'})", a))
                else:
                    out += self.terms(a, hidden, visited, adds)
            return out
        if n.op in _SCALE and len(n.ins) >= 2:
            a, b = n.ins[0], n.ins[1]
            sa = self.shape(a) if _is_key(a) else None
            sb = self.shape(b) if _is_key(b) else None
            if _is_key(b) and sb is None:
                sb = self._param_shape(b)
            if _is_key(a) and sa is None:
                sa = self._param_shape(a)
            if _is_key(a) and (not _is_key(b) or self._per_row(sb, hidden)) and (sa is None or sa[-1] == hidden):
                return self.terms(a, hidden, visited, adds)
            if n.op.startswith("mul") and _is_key(b) and self._per_row(sa, hidden) and sb is not None \
                    and sb[-1] == hidden:
                return self.terms(b, hidden, visited, adds)
            return [Term("other", f"a multiplicative term ({n.op} of two hidden-size values in "
                                  f"{n.module or '<model>'})", key)]
        if self._cat_rows(n) is not None:  # rows gathered from pieces: each row's terms are its piece's
            out = []
            for piece in self._cat_rows(n):
                out += self.terms(piece, hidden, visited, adds)
            return out
        if n.op in _MOVE:
            conv = self._conv_channels(key, hidden)
            if conv is not None:
                return [Term("writer", conv, key, fold.LINEAR)]
        if n.op == "embedding" and n.ins and n.ins[0] in self.tr.params:
            table = self.tr.params[n.ins[0]][0]
            mod = table.rsplit(".", 1)[0]
            if isinstance(self.modules.get(mod), nn.Embedding) and table.endswith(".weight"):
                return [Term("embedding", mod, key)]
        return [Term("other", f"{n.op} in {n.module or '<model>'}", key)]

    def _cat_rows(self, n: _Node) -> list | None:
        """The pieces of a torch.cat across a dimension other than the last (every output row is
        one piece's row), or None for any other node."""
        if n.op != "cat" or not n.ins or not isinstance(n.ins[0], list) or not n.shapes_out:
            return None
        out = n.shapes_out[0]
        dim = n.kw.get("dim", n.ins[1] if len(n.ins) > 1 else 0)
        pieces = n.ins[0]
        if not out or not isinstance(dim, int) or dim % len(out) == len(out) - 1 or not all(_is_key(k) for k in pieces):
            return None
        shapes = [self.shape(k) or self._param_shape(k) for k in pieces]
        return pieces if all(s is not None and len(s) == len(out) and s[-1] == out[-1] for s in shapes) else None

    def _conv_channels(self, key, hidden: int) -> str | None:
        """The convolution whose output channels are `key`'s last dimension, moved there by views,
        transposes and permutes only, with nothing else reading the values on the way (a patch
        embedding: conv, flatten, transpose); None when there is none. Its output rows center as a
        Linear's do (every channel is a weighted sum of the same inputs plus a bias)."""
        shape = self.shape(key)
        if not shape or shape[-1] != hidden:
            return None
        dim = len(shape) - 1
        first = True
        while True:
            if not first and len(self.tr.users.get(key, ())) != 1:
                # The convolution's output, or a value moved from it, is read elsewhere too:
                # centering would change that reader, which no stream check follows.
                return None
            first = False
            path = self.out_of.get(key)
            if path is not None and _centerable_conv(self.modules[path]):
                return path if dim == 1 and self.modules[path].out_channels == hidden else None
            i = self.tr.producer.get(key)
            if i is None:
                return None
            n = self.nodes[i]
            if n.op not in _MOVE or not n.ins or not _is_key(n.ins[0]) or not n.shapes_in or not n.shapes_out:
                return None
            dim = _dim_before(n, dim)
            if dim is None:
                return None
            key = n.ins[0]

    def _param_shape(self, key):
        names = self.tr.params.get(key)
        if not names:
            return None
        return tuple(self.model.get_parameter(names[0]).shape)

    # -- forward: who reads a value -------------------------------------------------------------

    def closure(self, keys: Iterable, through_adds: bool = True) -> tuple[set, list[tuple[int, tuple]]]:
        """Follow values forward through pass-throughs (and adds and per-row scalings); return
        (every value reached, the other uses as (node index, the key used))."""
        seen: set = set()
        todo = list(keys)
        uses: list[tuple[int, tuple]] = []
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            for i in self.tr.users.get(k, ()):
                n = self.nodes[i]
                if n.op in _SHAPE_ONLY:
                    continue
                if n.ins and n.ins[0] == k and self._splits_rows(n):
                    todo += n.outs  # every piece
                    continue
                if k in (self._cat_rows(n) or ()):
                    todo += n.outs[:1]  # rows of the gathered value
                    continue
                if self.pass_input(n) == k or through_adds and (n.op in _ADD and k in n.ins[:2]) or through_adds and (
                        n.op in _SCALE and n.ins and n.ins[0] == k
                        and (not _is_key(n.ins[1]) or self._per_row(self.shape(n.ins[1]) or
                                                                      self._param_shape(n.ins[1]), None))):
                    todo += n.outs[:1]
                else:
                    uses.append((i, k))
        return seen, uses

    def readers_of(self, path: str) -> list[str]:
        """The readers of module `path`'s output (norm_readers), over every run of it."""
        leaves, found = False, set()
        for c in self.tr.calls.get(path, []):
            passed, uses = self.closure(c.outs[:1], through_adds=False)
            # a sum of rows of the output (AST's pooler) is the output, as for the conversion
            # (_readers): leaving the model it is <output>, its readers are the sum's
            combined, uses = self._row_combinations(passed, uses)
            leaves |= bool((passed | combined) & self.tr.output_keys)
            found |= {self.nodes[i].module for i, _k in uses}
        return [OUTPUT] * leaves + sorted(found, key=lambda q: self.order.get(q, len(self.order)))

    def _layer_norm_input(self, i: int, k) -> bool:
        """Node i is a layer norm over the last dimension reading k: blind to a per-row shift."""
        n = self.nodes[i]
        shape = n.ins[1] if len(n.ins) > 1 else None
        return n.op in _LAYER_NORM_OPS and n.ins[0] == k and isinstance(shape, (list, tuple)) and len(shape) == 1

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> Discovery:
        tr = self.tr
        self.norm_set = set(self.norm_paths)
        found = {p: NormFinding(p) for p in self.norm_paths}
        if tr.error is not None:
            for f in found.values():
                f.refuse("untraced", tr.error)
            return Discovery(found, [], [], None, tr.error)

        # 1. Each norm's own form, input and output.
        x_of, y_of = {}, {}
        for p, f in found.items():
            calls = tr.calls.get(p, [])
            if not calls:
                f.refuse("untraced", "it never ran in the traced forward")
                continue
            if len(calls) > 1:
                f.refuse("shared-weights", f"it runs {len(calls)} times in one forward")
                continue
            if p in self.elsewhere:
                f.refuse("shared-weights", f"it runs in {self.tr.via} and in another traced call")
                continue
            c = calls[0]
            if not c.ins or not c.outs:
                f.refuse("untraced", "its input or output is not a tensor the trace saw")
                continue
            x_of[p], y_of[p] = c.ins[0], c.outs[0]
            self._check_form(p, f, c)

        # 2. Backward: the terms of each norm's input.
        visited_of: dict[str, set] = {}
        add_of: dict[str, list] = {}
        for p, f in found.items():
            if p not in x_of or f.hidden is None:
                continue
            visited: set = set()
            adds: list = []
            f.terms = self.terms(x_of[p], f.hidden, visited, adds)
            visited_of[p], add_of[p] = visited, adds
        for p, f in found.items():
            if p in visited_of:
                f.earlier = [q for q in self.norm_paths if q != p and x_of.get(q) in visited_of[p]]
                if not add_of[p] and all(t.kind == "other" for t in f.terms):
                    f.refuse("not-stream", f"its input is {f.terms[0].ref}, not a sum of residual-stream writers")

        # 3. Forward: the readers of each norm's output.
        for p, f in found.items():
            if p in y_of:
                self._readers(p, f, y_of[p])

        # 4. Embedding norms whose output is the stream: baked into their table where possible.
        bake: dict[str, str] = {}
        for p, f in found.items():
            if f.category == "post-ln" and f.reason == _OUTPUT_IS_STREAM and self._bakeable(p, f, found):
                bake[p] = f.terms[0].ref
                f.baked_table = f.terms[0].ref
                f.category = f.reason = None
                f.readers = [(STREAM, None)]

        # 5. Terms: every one must be centerable (or a baked norm's output).
        for p, f in found.items():
            if p not in visited_of or f.category is not None:
                continue
            if f.baked_table:
                continue
            for t in f.terms:
                if t.kind == "norm" and t.ref not in bake:
                    f.refuse("post-ln", f"its input holds the output of {t.ref} (the stream is a norm's output)")
                elif t.kind == "other":
                    f.refuse("uncenterable-term", f"a term of its input is {t.ref}")

        # 6. What gets centered, and whether each is only ever used where centering is harmless.
        converting = [p for p, f in found.items() if f.category is None]
        stray = self._stray_readers(found, converting, x_of, y_of, bake)
        for p in converting:
            if p in stray:
                found[p].refuse("stray-reader", stray[p])
        # A baked norm gains nothing unless a norm reading the stream it feeds converts too.
        for p in bake:
            if not any(t.kind == "norm" and t.ref == p for q, g in found.items() if g.category is None
                       for t in g.terms):
                f = found[p]
                f.baked_table, f.readers = None, []
                f.refuse("post-ln", _OUTPUT_IS_STREAM + ", and no norm reading that stream converts")
        converting = [p for p, f in found.items() if f.category is None]
        tables, writers, untie = self._centered(found, converting, bake)
        converting = [p for p, f in found.items() if f.category is None]
        params = sorted({t.ref for p in converting for t in found[p].terms if t.kind == "param"})
        return Discovery(found, tables, writers, untie, params=params)

    def _check_form(self, p: str, f: NormFinding, c: _Call) -> None:
        mod = self.modules[p]
        ops = self.ln_ops.get(p, [])
        if len(ops) != 1:
            f.refuse("norm-form", "it does not run F.layer_norm itself" if not ops else
                     f"it runs F.layer_norm {len(ops)} times")
            return
        n = self.nodes[ops[0]]
        shape = n.ins[1] if len(n.ins) > 1 else None
        x_shape = n.shapes_in[0]
        if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not x_shape or x_shape[-1] != shape[0]:
            f.refuse("norm-form", f"it normalises over {list(shape) if shape else '?'}, not the last dimension")
            return
        f.hidden = int(shape[0])
        eps = n.ins[4] if len(n.ins) > 4 else n.kw.get("eps")
        f.eps = float(eps) if isinstance(eps, (int, float)) else None
        x_chain = self._chain_back(n.ins[0], c.ins[0])
        if x_chain is None:
            f.refuse("norm-form", "F.layer_norm does not read the module's input as is")
            return
        own = set(x_chain) | {ops[0]}
        for slot, attr in ((2, "weight"), (3, "bias")):
            arg = n.ins[slot] if len(n.ins) > slot else None
            param = getattr(mod, attr, None)
            if param is None and arg is None:
                continue
            if param is None or arg is None or not self._is_param(arg, f"{p}.{attr}", own):
                f.refuse("norm-form", f"its F.layer_norm {attr} is not the module's own {attr} parameter "
                         "(a 1 + w gain or a computed value)")
                return
        y_chain = self._chain_back(c.outs[0], n.outs[0])
        if y_chain is None:
            f.refuse("norm-form", "its output is not F.layer_norm's output (something is applied after it)")
            return

    def _chain_back(self, key, target) -> list[int] | None:
        """Node indices of a pass-through chain leading from `target` to `key` (None: no chain)."""
        chain = []
        while key != target:
            i = self.tr.producer.get(key)
            if i is None:
                return None
            src = self.pass_input(self.nodes[i])
            if src is None:
                return None
            chain.append(i)
            key = src
        return chain

    def _is_param(self, key, name: str, own: set) -> bool:
        while True:
            if name in self.tr.params.get(key, ()):
                return True
            i = self.tr.producer.get(key)
            if i is None:
                return False
            n = self.nodes[i]
            if n.op not in ("_to_copy", "to", "alias", "detach", "clone", "view", "lift_fresh"):
                return False
            own.add(i)
            key = n.ins[0]

    def _readers(self, p: str, f: NormFinding, y) -> None:
        if f.category is not None:
            return
        passed, uses = self.closure([y], through_adds=False)
        combined, uses = self._row_combinations(passed, uses)
        if (passed | combined) & self.tr.output_keys:
            f.readers.append((OUTPUT, None))
        for i, k in uses:
            if k in combined:
                # γ and β can stay in the norm for a combination that leaves the model (its
                # output is then exactly the original's), but a module reading it would need
                # them folded through the combination's coefficients, which are not followed.
                n = self.nodes[i]
                f.refuse("nonlinear-reader", f"{n.op} in {n.module or '<model>'} reads a sum of rows of its output")
                return
        readers: dict[str, str] = {}
        for i, k in uses:
            n = self.nodes[i]
            if n.op in _ADD or n.op in _SCALE or self._layer_norm_input(i, k):
                f.refuse("post-ln", _OUTPUT_IS_STREAM)
                return
        for i, _k in uses:
            n = self.nodes[i]
            mod = self.modules.get(n.module)
            o = fold_orientation(mod) if mod is not None else None
            calls = self.tr.calls.get(n.module, [])
            if o is None or not any(c.ins and c.ins[0] in passed for c in calls):
                f.refuse("nonlinear-reader", f"{n.op} in {n.module or '<model>'} reads its output")
                return
            if len(calls) > 1:
                f.refuse("shared-weights", f"its reader {n.module} runs {len(calls)} times in one forward")
                return
            if _in_features(mod) != f.hidden:
                f.refuse("nonlinear-reader", f"its reader {n.module} does not take the hidden size as input")
                return
            readers[n.module] = o
        f.readers += sorted(readers.items(), key=lambda r: self.order[r[0]])

    def _row_combinations(self, passed: set, uses: list) -> tuple[set, list]:
        """(values, other uses): the values that are sums of rows of the norm's output, scaled by
        constants (AST's pooler: (y[:, 0] + y[:, 1]) / 2), with the uses of `passed` and of them
        that are not such a sum. An add of two rows of the output is no residual add: nothing
        from outside the output enters it, so it holds no stream a later norm would read."""
        combined: set = set()
        while True:
            new, rest = [], []
            for i, k in uses:
                n = self.nodes[i]
                ins = [a for a in n.ins[:2] if _is_key(a)]
                rows_added = (n.op in ("add", "sub") and len(ins) == 2 and n.kw.get("alpha", 1) == 1
                              and all(a in passed or a in combined for a in ins))
                scaled = (n.op in ("mul", "div") and k in combined and n.ins[0] == k and len(n.ins) > 1
                          and not _is_key(n.ins[1]))
                if rows_added or scaled:
                    new += [o for o in n.outs[:1] if o not in combined]
                else:
                    rest.append((i, k))
            if not new:
                return combined, rest
            reached, more = self.closure(new, through_adds=False)
            combined |= reached
            uses = rest + more

    def _bakeable(self, p: str, f: NormFinding, found) -> bool:
        return (len(f.terms) == 1 and f.terms[0].kind == "embedding" and f.eps is not None and f.eps > 0
                and not any(t.kind == "embedding" and t.ref == f.terms[0].ref
                            for q, g in found.items() if q != p for t in g.terms))

    def _stray_readers(self, found, converting, x_of, y_of, bake) -> dict[str, str]:
        """norm -> a reason, for norms whose stream someone reads without a norm in front."""
        term_owner: dict = {}  # term key -> norms whose input holds it
        for p in converting:
            for t in found[p].terms:
                term_owner.setdefault(t.key, set()).add(p)
        reached, uses = self.closure(list(term_owner))
        out: dict[str, str] = {}
        bad = []
        for i, k in uses:
            if self._layer_norm_input(i, k):
                continue
            n = self.nodes[i]
            bad.append((k, f"{n.op} in {n.module or '<model>'}"))
        bad += [(k, "the model's output") for k in reached & self.tr.output_keys]
        if not bad:
            return out
        # Which norms' streams include the value read: those sharing any of its terms.
        for k, what in bad:
            shape = self.shape(k)
            terms = [Term("", "", k)] if k in term_owner or not shape else self.terms(k, shape[-1], set(), [])
            keys = {t.key for t in terms}
            for key in keys:
                for p in term_owner.get(key, ()):
                    out.setdefault(p, f"{what} reads the residual stream without a norm in front of it")
        return out

    def _centered(self, found, converting, bake):
        """(tables, writers, untie) for the norms that convert. Every module touched must run once
        and own its parameters alone (a tie of the output embeddings with a table is untied);
        where not, the norms involved are refused and the rest recomputed."""
        tables: dict[str, None] = {}
        writers: dict[str, str] = {}
        term_keys = set()
        for p in converting:
            f = found[p]
            for t in f.terms:
                term_keys.add(t.key)
                if t.kind == "embedding" and not f.baked_table:
                    tables[t.ref] = None
                elif t.kind == "writer":
                    writers[t.ref] = t.orientation
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        head_path = next((q for q, m in self.modules.items() if m is head), None) if head is not None else None
        readers = {r for p in converting for r, _ in found[p].readers if r not in (OUTPUT, STREAM)}
        baked = {found[p].baked_table for p in converting if found[p].baked_table}
        untie = None
        problems: dict[str, str] = {}
        for m in [*tables, *writers, *readers, *baked]:
            calls = self.tr.calls.get(m, [])
            if m in self.elsewhere:
                problems[m] = f"{m} runs in {self.tr.via} and in another traced call"
            if len(calls) > 1 and m not in tables and m not in baked:
                problems[m] = f"{m} runs {len(calls)} times in one forward"
            for attr in ("weight", "bias"):
                prm = getattr(self.modules[m], attr, None)
                if prm is None:
                    continue
                key = _key(prm)
                names = self.tr.params.get(key, [f"{m}.{attr}"])
                others = [n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[0] != m]
                tie = None
                if attr == "weight" and head_path is not None and len(others) == 1 and head_path in (m, others[0]):
                    tie = (head_path, others[0] if m == head_path else m)
                    untie = tie
                elif others:
                    problems[m] = f"{m}.{attr} is shared with {others[0]}"
                    continue
                allowed = {m, *(tie or ())}
                for i in self.tr.users.get(key, ()):
                    n = self.nodes[i]
                    if n.op == "embedding" and m in tables and n.module == m and n.outs[0] not in term_keys:
                        problems[m] = f"a lookup in {m} goes somewhere other than the residual stream"
                    elif n.module not in allowed:
                        problems[m] = f"{m}.{attr} is used by {n.module or '<model>'} too"
        if problems:
            for p in converting:
                f = found[p]
                mine = {t.ref for t in f.terms} | {r for r, _ in f.readers} | {f.baked_table}
                hit = next((why for m, why in problems.items() if m in mine), None)
                if hit is not None:
                    f.refuse("shared-weights", hit)
            converting = [p for p in converting if found[p].category is None]
            return self._centered(found, converting, bake) if converting else ([], [], None)
        if untie is not None and untie[1] not in tables and untie[1] not in baked and head_path not in readers:
            untie = None
        return sorted(tables, key=self.order.get), sorted(writers.items(), key=lambda w: self.order[w[0]]), untie


_OUTPUT_IS_STREAM = "its output is added into the residual stream (the stream is this norm's output)"


def fold_orientation(mod: nn.Module | None) -> str | None:
    """How a layer stores its weight, when γ/β can be folded into it or its output centered."""
    if isinstance(mod, nn.Linear):
        return fold.LINEAR
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):
        return fold.CONV1D
    return None


def _centerable_conv(mod: nn.Module) -> bool:
    """A convolution whose every output channel reads every input channel (groups 1): its output
    rows over the channels center as a Linear's."""
    return isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and mod.groups == 1


def _dim_before(n: _Node, dim: int) -> int | None:
    """The dimension of node n's input that its output's dimension `dim` was (n moves dimensions
    only: transpose, permute, a view keeping that dimension whole), or None."""
    src, out = list(n.shapes_in[0]), list(n.shapes_out[0])
    if n.op == "transpose":
        a, b = (d % len(out) for d in n.ins[1:3])
        return b if dim == a else a if dim == b else dim
    if n.op == "permute":
        return n.ins[1][dim] % len(src)
    if n.op in ("view", "_unsafe_view", "reshape"):
        before = math.prod(out[:dim])
        for j, size in enumerate(src):
            if size == out[dim] and math.prod(src[:j]) == before:
                return j
        return None
    return dim if src == out else None


def _in_features(mod: nn.Module) -> int | None:
    if isinstance(mod, nn.Linear):
        return mod.in_features
    w = getattr(mod, "weight", None)
    return int(w.shape[0]) if w is not None else None
