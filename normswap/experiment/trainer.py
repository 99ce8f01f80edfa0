"""The training loop every arm (and the pretraining) runs: accelerate, checkpoints, resume.

Reproducibility and the DDP equivalence both come from how batches are drawn: the sequences of
optimizer step s are a pure function of (seed, s): `grad_accum * num_processes` micro-batches of
random windows of the token stream, and process r takes micro-batches [r*grad_accum, (r+1)*grad_accum).
So two processes with accumulation A see, per step, exactly the sequences one process with
accumulation 2A sees, and DDP's gradient average equals that process's mean; a resumed run draws
the batches the uninterrupted run would have drawn, given as many processes (another count draws
other sequences per step: check_resumable refuses that resume). The learning rate is a pure function of the
step too, so a checkpoint needs only the model, the optimizer (accelerate's save_state, which
also keeps the RNG states that dropout uses) and the history.

Checkpoints: <state_dir>/step-NNNNNN/ (accelerate's save_state plus trainer.json), then LATEST is
replaced atomically to point at it, then older ones are removed; a kill at any moment leaves the
previous LATEST intact. Ctrl-C (SIGINT) sets a flag the loop checks after each step: it saves a
checkpoint and raises Interrupted; a second Ctrl-C interrupts at once (the last checkpoint stays).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import reprlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from normswap import jsonsafe
from normswap._env import launched_main
from normswap.errors import EveryProcessError, NormswapError, one_line, way_out
from normswap.experiment import processes
from normswap.experiment.recipe import TrainSettings, recipe_key
from normswap.experiment.report import count_noun
from normswap.progress import isatty

LATEST = "LATEST"
TRAINER_STATE = "trainer.json"


class Interrupted(NormswapError):
    """Training stopped on request (Ctrl-C) after saving a checkpoint: rerun to resume."""


class StopFlag:
    """Set by Ctrl-C or SIGTERM (or by a caller, e.g. a test simulating Ctrl-C); checked after every
    step and, by run_experiment, before every arm. `signal` is the signal that set it (None when a caller did)."""

    def __init__(self):
        self._event = threading.Event()
        self.signal: int | None = None

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    @contextlib.contextmanager
    def on_interrupt(self):
        """First Ctrl-C or SIGTERM: finish the step, checkpoint, stop. SIGTERM too, because it is
        what a batch scheduler's cancel and `docker stop` send, usually with some seconds' grace
        before SIGKILL: enough to keep the steps since the last checkpoint. A second signal: the
        handler that was there before, now (KeyboardInterrupt; the command line's Terminated)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        # A signal ignored by whoever started us stays ignored: a shell script's background job
        # ('normswap experiment ... &') ignores SIGINT, so that a Ctrl-C meant for the script's
        # foreground command leaves it running (it stopped the training)
        previous = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) is not signal.SIG_IGN}

        def handler(signum, frame):
            if self.is_set():
                for s, h in previous.items():
                    signal.signal(s, h)
                if callable(previous[signum]):
                    previous[signum](signum, frame)
                else:  # the default action (or none, for an ignored signal), as if we had not been here
                    signal.raise_signal(signum)
                return
            again = "Ctrl-C" if signum == signal.SIGINT else "a second SIGTERM"
            # On a terminal the bar's line is open: end it first (elsewhere that was a blank line).
            line_break = "\n" if isatty(sys.stderr) else ""
            if launched_main():  # the launcher signals every process: the notice came once per process
                print(f"{line_break}normswap: stopping after this step or evaluation (checkpointing; {again} to "
                      "stop now)", file=sys.stderr)
            self.signal = signum
            self.set()

        for s in previous:
            signal.signal(s, handler)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def resolve_mixed_precision(value: str) -> str:
    """A recipe's mixed_precision as accelerate takes it: `auto` is bf16 on a GPU that has it,
    fp16 on another GPU, else no."""
    if value != "auto":
        return value
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def lr_at(s: TrainSettings, step: int) -> float:
    """Linear warm-up to s.lr, then constant / linear / cosine decay to 0 at s.steps."""
    if s.warmup_steps and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "constant":
        return s.lr
    span = max(1, s.steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    if s.schedule == "linear":
        return s.lr * (1.0 - progress)
    return s.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class RandomWindows:
    """Training batches: random windows of seq_len tokens from one token stream (see the module doc)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        check_training_text(ids.numel(), seq_len)
        self.ids, self.seq_len, self.batch_size, self.seed = ids, seq_len, batch_size, seed

    def micro_batches(self, step: int, rank: int, world: int, grad_accum: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = grad_accum * world * self.batch_size
        check_step_fits(n, self.seq_len)
        try:
            rows = torch.empty((n, self.seq_len), dtype=self.ids.dtype)
            starts = torch.randint(0, self.ids.numel() - self.seq_len, (n,), generator=g)
            # Row i is ids[starts[i]: starts[i] + seq_len], gathered from the windows' view in one
            # call: a Python loop over the rows took minutes and gigabytes of tensor objects for a
            # batch_size of 10**8 before the allocation could fail.
            torch.index_select(self.ids.unfold(0, self.seq_len, 1), 0, starts, out=rows)
        except (RuntimeError, MemoryError, TypeError) as e:  # a size the recipe chose, not a bug (past int64:
            # randint fails its argument parsing with a TypeError)
            raise NormswapError(_step_too_large(n, self.seq_len, one_line(e))) from None
        mine = rows.view(grad_accum * world, self.batch_size, self.seq_len)[rank * grad_accum:(rank + 1) * grad_accum]
        return list(mine)


def check_training_text(tokens: int, seq_len: int, at_most: str | None = None) -> None:
    """Refuse a training text of `tokens` tokens, too short for one sequence of seq_len + 1 (inputs
    and their next tokens). at_most: `tokens` is only the most the text can hold, for the reason
    given (a tokenizer not trained yet), and the message says so."""
    if tokens <= seq_len:
        count = f"{tokens} token{'s' * (tokens != 1)}"
        count = count if at_most is None else f"at most {count} ({at_most})"
        raise NormswapError(f"the training text has {count}, fewer than one sequence of {seq_len + 1}")


def check_step_fits(n: int, seq_len: int) -> None:
    """Refuse a step of `n` sequences of `seq_len` token ids that alone take more than the machine's
    memory: with the kernel's overcommit, the allocation of such a batch can succeed and the
    process (or another one) be killed once it is filled."""
    need, have = n * seq_len * 8, physical_memory()
    if have is not None and need > have:
        raise NormswapError(_step_too_large(n, seq_len, f"{need / 2**30:,.1f} GiB of token ids, more than this "
                                                        f"machine's {have / 2**30:,.1f} GiB of memory"))


def _step_too_large(n: int, seq_len: int, why: str) -> str:
    return (f"a step of {n} sequences (batch_size x grad_accum x processes) of {seq_len} tokens: cannot allocate "
            f"it ({why}); lower batch_size, grad_accum or seq_len")


def physical_memory() -> int | None:
    """The machine's memory in bytes, None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def build_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not on norm gains, biases or 1-D tensors), the usual GPT recipe.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if s.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=s.lr, momentum=0.9)
    # AdamW's eps is added to sqrt(v) in the weights' dtype: torch's 1e-8 is 0 in float16, so every
    # weight whose gradient was 0 (an embedding row no batch used) became 0/0 = NaN at the first
    # step, whatever the learning rate (finetune.dtype = "fp16": "the training loss is nan at step 2").
    # The smallest normal number of the dtype instead where 1e-8 is below it (float16 only).
    dtype = params[0].dtype if params else torch.float32
    eps = max(1e-8, torch.finfo(dtype).tiny) if dtype.is_floating_point else 1e-8
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=eps)


def lm_loss(model, ids: torch.Tensor, teacher=None) -> torch.Tensor:
    """Next-token cross-entropy (mean over the predicted tokens)."""
    return model(input_ids=ids, labels=ids).loss


@contextlib.contextmanager
def _uncached_casts():
    """Autocast without its weight cache: under mixed precision autocast keeps the half-precision copy
    of every weight that requires grad until the step's autocast region ends (through the arm's forward
    and backward). The teacher's weights require grad (they are the original's, which later arms are
    copied from and train), but nothing differentiates them: cached, a half-precision copy of the
    teacher's matrices would sit in memory through the step's peak."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


def distill_loss(model, ids: torch.Tensor, teacher) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ model) of the next-token distributions."""
    # What it costs over lm_loss is inherent: a second forward (the teacher's, without backward) and a
    # KL over the whole vocabulary (the teacher's log-softmax, its exp, a product with every logit)
    # where cross-entropy reads one logit per position. benchmarks/experiment_step.py (CPU time, one
    # thread, 2026-11-24): a step 1.60x an lm step on smoke-kjv-tiny's model (the teacher's forward
    # 0.33x, the KL most of the rest: a model that small is mostly its output layer), 1.38x on
    # ln2rms-kjv-gpt2's (teacher 0.34x).
    with torch.no_grad(), _uncached_casts():
        target = torch.log_softmax(teacher(input_ids=ids).logits.float(), dim=-1)
    logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    v = logp.shape[-1]
    return torch.nn.functional.kl_div(logp.reshape(-1, v), target.reshape(-1, v), log_target=True,
                                      reduction="batchmean")


LOSSES = {"lm": lm_loss, "distill": distill_loss}


@dataclass
class History:
    """What a run has produced so far; saved with every checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)  # per optimizer step (mean over the global batch)
    evals: list[dict] = field(default_factory=list)  # {"step": s, ...metrics}
    train_seconds: float = 0.0
    # The processes that trained it: the sequences of a step depend on their count (RandomWindows).
    # None in a checkpoint written before it was recorded (check_resumable then reads it from the ranks
    # of accelerate's files).
    num_processes: int | None = None

    def to_dict(self) -> dict:
        return {"step": self.step, "losses": self.losses, "evals": self.evals, "train_seconds": self.train_seconds,
                "num_processes": self.num_processes}


def latest_checkpoint(state_dir: Path) -> Path | None:
    """The checkpoint LATEST names; None where there is no LATEST (nothing committed yet). A LATEST
    that names no checkpoint of this folder (emptied, hand-edited, '../other-run/step-000050') is
    refused, naming the way out: read as "no checkpoint", the training began again at step 0 and its
    first checkpoint removed every step-* folder beside it, the real one included (or it resumed
    another run's checkpoint)."""
    pointer = state_dir / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    remedy = f"delete {state_dir} to train from the start"
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        if isinstance(e, PermissionError):  # this user's, not the checkpoint's: deleting would lose a sound one
            remedy = "it is kept: run again as a user who may read it"
        raise NormswapError(f"{pointer}: cannot read it ({one_line(e)}); {remedy}") from None
    if not re.fullmatch(r"step-\d{6,}", name) or not (state_dir / name / TRAINER_STATE).is_file():
        raise NormswapError(f"{pointer} names {name!r}, which is no checkpoint in {state_dir} (a step-NNNNNN "
                            f"folder holding {TRAINER_STATE}); {remedy}")
    return state_dir / name


def _read_history(path: Path, remedy: str) -> History:
    """A checkpoint's History, refused as bad input when the file is not what _save wrote: another
    shape, or fields of another kind (a step of "2" or null, losses that are no list: the resumed
    training failed on them with a TypeError or AttributeError), or losses that are not one per step."""
    fields = jsonsafe.read_or_refuse(path, remedy)
    try:
        h = History(**fields)
    except TypeError:  # not an object, or other fields
        raise NormswapError(f"{path}: not a training state (an object of {', '.join(History().to_dict())}); "
                            f"{remedy}") from None

    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not count(h.step):
        wrong = f"step is {reprlib.repr(h.step)}"
    elif not (isinstance(h.losses, list) and all(map(number, h.losses))):
        wrong = f"losses is {reprlib.repr(h.losses)}"
    elif len(h.losses) != h.step:  # one per step, from step 1: a step of 10**6 "finished" the arm at once
        wrong = f"{len(h.losses)} losses for step {h.step}, one per step"
    elif not (isinstance(h.evals, list) and all(isinstance(e, dict) for e in h.evals)):
        wrong = f"evals is {reprlib.repr(h.evals)}"
    elif not number(h.train_seconds):
        wrong = f"train_seconds is {reprlib.repr(h.train_seconds)}"
    elif not (h.num_processes is None or count(h.num_processes)):
        wrong = f"num_processes is {reprlib.repr(h.num_processes)}"
    else:
        return h
    raise NormswapError(f"{path}: not a training state that normswap wrote ({wrong}); {remedy}")


def check_resumable(state_dir: Path, num_processes: int, what: str) -> tuple[Path, History] | None:
    """The checkpoint in state_dir to resume and its history (None: there is none), or a refusal
    (NormswapError, nothing removed) to resume it under another number of processes than the one
    that wrote it: a step's sequences are grad_accum x processes draws (RandomWindows), so the
    resumed steps would see other batches, a bigger or smaller batch than the steps before them,
    and the result would belong to neither process count. A checkpoint that says no count (none
    recorded, no random-state files) is refused too: normswap never writes one; and so is one that
    lacks a process's random-state file (accelerate would resume that process from another random
    state, unsaid). `what` names the training in the message (an arm, "pretrain")."""
    found = latest_checkpoint(state_dir)
    if found is None:
        return None
    history = _read_history(found / TRAINER_STATE, f"delete {state_dir} to train from the start")
    # A checkpoint from before the count was recorded (4a66f5b): accelerate's save_state writes one
    # RNG file per process, always, so every checkpoint normswap wrote says its count one way or the other.
    saved = history.num_processes or _ranks_saved(found)
    if saved is None:  # resumed unchecked, it could continue another count's run with this one's batches
        raise NormswapError(f"{what}: its checkpoint {found} records no process count (num_processes in "
                            f"{TRAINER_STATE}) and holds no random-state files (random_states_*.pkl); every "
                            "checkpoint normswap writes has one or the other, so it is not one normswap wrote, or "
                            "not whole, and cannot be resumed as the run it belongs to; "
                            f"delete {state_dir} to train it from the start")
    if saved != num_processes:
        trained_on = count_noun(saved, "process")
        raise NormswapError(f"{what}: its checkpoint at step {history.step} was trained on {trained_on} and this "
                            f"run has {num_processes}: the process count decides the batches, so the resumed "
                            f"steps would see other data; run it again on {trained_on}, or delete {state_dir} "
                            f"to train it from the start on {num_processes}")
    # accelerate's load_state reads random_states_<rank>.pkl on each process and, when it is missing,
    # only logs it: the resumed steps would draw dropout from this start's random state, not the
    # interrupted run's, and nothing would say so. Every rank's file is checked on every process (a
    # shared folder gives each the same answer, so all refuse together rather than one rank leaving
    # the others at the next barrier); a node that holds only its own ranks' files (several nodes
    # without a shared file system) lacks the main process's model and optimizer files too.
    # (After the count's check: the loop is as long as this run's count, whatever the file says.)
    missing = [name for name in (f"random_states_{rank}.pkl" for rank in range(num_processes))
               if not (found / name).is_file()]
    if missing:
        raise NormswapError(f"{what}: its checkpoint {found} was written by {count_noun(saved, 'process')} but "
                            f"lacks {', '.join(missing)} (accelerate writes one random-state file per process; "
                            "resumed without it, the steps would go on from another random state than the "
                            "interrupted run's, unsaid); put it back, or delete "
                            f"{state_dir} to train it from the start")
    return found, history


def _ranks_saved(found: Path) -> int | None:
    """The process count of a checkpoint that does not record it, from accelerate's files: one more
    than the highest rank with a random_states_<rank>.pkl (None: there is none). Not how many such
    files there are: one file lost (rank 0's of two) made a checkpoint of 2 read as one of 1, so the
    resume on 2 was refused as 'trained on 1 process, run it again on 1' and the run on 1 for the
    file it lacks; and a copy beside a file (random_states_0 copy.pkl, which the glob matched) made a
    sound one of 1 read as one of 2. Only the top rank's file lost is beyond what names can tell:
    the count is then one short, as the checkpoint's files are. Nothing else says it: accelerate's
    other files (model, optimizer: the main process's) and each RNG file's contents (its step, the
    process's generators) hold no count, no scheduler or sampler is prepared, and OUT's records of
    it (an arm's result.json, results.json's environment) are of finished arms and invocations."""
    ranks = [int(m[1]) for p in found.glob("random_states_*.pkl")
             if (m := re.fullmatch(r"random_states_([0-9]+)\.pkl", p.name))]
    return max(ranks) + 1 if ranks else None


def _save(accelerator, state_dir: Path, history: History) -> None:
    name = f"step-{history.step:06d}"
    target = state_dir / name
    with processes.together():
        if accelerator.is_main_process and target.exists():
            shutil.rmtree(target)
    # torch files, not safetensors: GPT-2's tied lm_head/wte round-trip without a warning
    with processes.together():  # each process writes its own random state
        accelerator.save_state(str(target), safe_serialization=False)
    with processes.together():
        if accelerator.is_main_process:
            (target / TRAINER_STATE).write_text(json.dumps(history.to_dict()))
            tmp = state_dir / f".{LATEST}.tmp"
            tmp.write_text(name)
            os.replace(tmp, state_dir / LATEST)  # the commit point: a kill before it keeps the old one
            for old in state_dir.glob("step-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _out_of_memory_is_bad_input(where: str):
    """A micro-batch too large for the device is the recipe's size, not a bug: one line naming the
    knobs (the last checkpoint stays; a rerun with smaller settings is another recipe)."""
    try:
        yield
    except Exception as e:
        if not _out_of_memory(e):
            raise
        raise NormswapError(f"{where}: out of memory ({one_line(e)}); lower batch_size or seq_len "
                            "(grad_accum keeps the batch)") from None


def _out_of_memory(e: BaseException) -> bool:
    """torch's and Python's out-of-memory errors, and the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError | MemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e)))


@contextlib.contextmanager
def _overflow_is_bad_input(where: str, lr: float, s: TrainSettings):
    """An update the weights' dtype cannot hold is the recipe's learning rate (or SGD's weight decay),
    not a bug: torch refuses to turn a step size past the dtype's range (lr = 1e308 in float32, 1e5
    in float16) into the weights' type, which was an internal error (exit 1). A smaller but still
    absurd rate trains into a non-finite loss, which the step's check reports the same way. Named
    as the recipe keys and the values the user wrote (`lr` is the schedule's at this step: in the
    warm-up a fraction of it, which the user never wrote)."""
    try:
        yield
    except RuntimeError as e:
        if "without overflow" not in str(e):
            raise
        keys = [f"{recipe_key(s, 'lr')} = {s.lr!r}"]
        if lr != s.lr:
            keys[0] += f" ({lr:g} at this step of the schedule)"
        if s.weight_decay:  # SGD adds weight_decay x the weights to the gradient in their dtype
            keys.append(f"{recipe_key(s, 'weight_decay')} = {s.weight_decay!r}")
        lower = " or ".join(k.partition(" ")[0] for k in keys)
        raise NormswapError(f"{where}: the update at {' and '.join(keys)} overflows the weights' dtype "
                            f"({one_line(e)}); lower {lower}") from None


def _lower_lr(s: TrainSettings) -> str:
    """What to do about a loss that is no longer finite: a lower learning rate, named as the recipe
    names it, and (under run_experiment) force, since its OUT now holds a run of this one: the rerun
    with another was refused as another recipe's, and the folder had to be removed by hand."""
    way = way_out("force", True, "")
    return f"lower {recipe_key(s, 'lr')} ({s.lr!r} now)" + (f", then run again with {way} to replace this run"
                                                           if way else "")


def any_process(accelerator, flag: bool) -> bool:
    """True on every process when it is true on one. Ctrl-C reaches each process of an `accelerate
    launch` at its own moment: were each to act on its own flag, one would enter the checkpoint's
    barrier while another started the next step's all-reduce, and both would hang."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor(float(flag), device=accelerator.device)
    return accelerator.reduce(t, reduction="sum").item() > 0


def train(
    accelerator,
    model: torch.nn.Module,
    settings: TrainSettings,
    batches: RandomWindows,
    state_dir: Path,
    *,
    loss: str = "lm",
    teacher: torch.nn.Module | None = None,
    evaluate: Callable[[torch.nn.Module, int], dict] | None = None,
    eval_every: int | None = None,
    stop: StopFlag | None = None,
    progress: bool = True,
    desc: str = "train",
    log_prefix: str = "",
    on_step: Callable[[int, float], None] | None = None,
) -> History:
    """Train `model` for settings.steps optimizer steps, resuming from state_dir when it holds a
    checkpoint. `evaluate(model, step)` (main process) runs at step 0 and every eval_every steps
    and at the end; its dict lands in history.evals. on_step(step, loss) runs after every
    optimizer step (before the checkpoint decision: it may set `stop`). Returns the history (complete on every
    process for losses; evals on the main process)."""
    from normswap.progress import stderr_bar

    with processes.together():  # every process checks (an interrupted pretraining's): its refusal said once
        resumed = check_resumable(state_dir, accelerator.num_processes, desc)  # before anything is prepared
    state_dir.mkdir(parents=True, exist_ok=True)
    loss_fn = LOSSES[loss]
    optimizer = build_optimizer(model, settings)
    model, optimizer = accelerator.prepare(model, optimizer)
    if teacher is not None:
        # Its forward runs under no_grad and without autocast's weight cache (distill_loss): its
        # parameters' requires_grad is left alone.
        # The teacher is the caller's model (the runner's original, every arm's source): freezing it
        # here froze every arm built after a distillation arm, whose training then had nothing to train.
        teacher = teacher.to(accelerator.device).eval()
    history = History()
    if resumed is not None:
        found, history = resumed
        try:
            with processes.together():  # each process reads its own random state
                accelerator.load_state(str(found))
        except EveryProcessError:
            raise
        except Exception as e:  # noqa: BLE001  (what accelerate's reader raises on files it did not write:
            # a truncated model.bin is torch's RuntimeError, a missing optimizer.bin FileNotFoundError, ...)
            if _out_of_memory(e) or isinstance(e, PermissionError):
                # the place, not the checkpoint: "delete it" would have thrown away a sound one
                then = "with more memory free" if _out_of_memory(e) else "as a user who may read it"
                raise NormswapError(f"{desc}: cannot resume from its checkpoint {found} ({one_line(e)}); it is "
                                    f"kept: run again {then}") from None
            raise NormswapError(f"{desc}: cannot resume from its checkpoint {found} ({one_line(e)}); delete "
                                f"{state_dir} to train from the start") from None
    rank, world = accelerator.process_index, accelerator.num_processes
    history.num_processes = world
    ga = settings.grad_accum
    stop = stop or StopFlag()

    def run_eval(step: int) -> None:
        if evaluate is None:
            return
        with processes.together():
            if accelerator.is_main_process:
                metrics = evaluate(accelerator.unwrap_model(model), step)
                history.evals.append({"step": step, **metrics})
                accelerator.log({f"{log_prefix}eval/{k}": v for k, v in metrics.items()
                                 if isinstance(v, int | float)}, step=step)

    if history.step == 0 and not history.evals:
        run_eval(0)
    # A resumed run says so: its bar starts part-way and its time counts from the resume.
    resumed = f" (resumed at step {history.step})" if history.step else ""
    bar = stderr_bar(total=settings.steps, initial=history.step, desc=desc + resumed, unit="step",
                     disable=not (progress and accelerator.is_main_process))
    started = time.perf_counter()
    base_seconds = history.train_seconds
    with bar:
        while history.step < settings.steps:
            step = history.step
            lr = lr_at(settings, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.train()
            total = torch.zeros((), device=accelerator.device)
            with _out_of_memory_is_bad_input(f"{desc}: step {step + 1}"):
                for k, ids in enumerate(batches.micro_batches(step, rank, world, ga)):
                    ids = ids.to(accelerator.device)
                    # Gradients are all-reduced only on the last micro-batch of the step.
                    sync = contextlib.nullcontext() if k == ga - 1 else accelerator.no_sync(model)
                    with sync, accelerator.autocast():
                        value = loss_fn(model, ids, teacher)
                        accelerator.backward(value / ga)
                    total += value.detach().float()
            if settings.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            with _overflow_is_bad_input(f"{desc}: step {step + 1}", lr, settings):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_loss = accelerator.reduce(total / ga, reduction="mean").item()
            if not math.isfinite(step_loss):  # the reduced loss: every process stops here
                raise EveryProcessError(f"{desc}: the training loss is {step_loss} at step {step + 1}: "
                                        f"{_lower_lr(settings)}")
            history.losses.append(step_loss)
            history.step = step + 1
            history.train_seconds = base_seconds + time.perf_counter() - started
            accelerator.log({f"{log_prefix}train/loss": step_loss, f"{log_prefix}train/lr": lr}, step=history.step)
            # significant digits: a distillation loss of 8e-6 showed as loss=0.0000
            bar.set_postfix(loss=f"{step_loss:.5g}", refresh=False)
            bar.update(1)
            if on_step is not None:
                on_step(history.step, step_loss)
            if eval_every and (history.step % eval_every == 0 or history.step == settings.steps):
                run_eval(history.step)
            stopping = any_process(accelerator, stop.is_set())
            if history.step % settings.checkpoint_every == 0 or history.step == settings.steps:
                _save(accelerator, state_dir, history)
            elif stopping:
                _save(accelerator, state_dir, history)
            if stopping and history.step < settings.steps:
                raise Interrupted(f"{desc}: stopped at step {history.step} of {settings.steps}; "
                                  "run the same command again to resume")
    if not eval_every and evaluate is not None and (not history.evals or history.evals[-1]["step"] != history.step):
        run_eval(history.step)
    accelerator.free_memory()  # drop accelerate's references, so the next arm's save_state holds only its model
    return history
