"""run_experiment: a recipe, every arm, evaluated from step 0, reported.

Layout of OUT:
  recipe.json              the validated recipe and its texts' digests (a rerun with a different one is refused, naming what differs)
  arms/<arm>/state/        the arm's resumable checkpoint while it trains (resumed only by as many processes)
  arms/<arm>/result.json   the arm's evaluations and losses once it is done (a rerun skips it; the reports include it)
  logs/                    accelerate trackers (TensorBoard event files when installed)
  results.json results.csv summary.md curves.png

The noise floor: when finetune.dtype is half precision every arm runs in it, and its KL from the
float32 original mixes what the arm changed with what rounding does. The `original` arm's model in
that dtype is scored against the float32 original once per invocation (its scores do not change over
steps); results.json's `noise_floor` holds that distance, and every evaluation of every arm is judged
against it by normswap.evaluate.judge_noise (the judgement `diff` and `patch --eval` print), as its
own `noise_floor` (kl_ratio, within, verdict). Judging when the report is assembled, not when an arm
is evaluated, keeps a resumed run's report consistent: arms finished by an earlier invocation are
judged against the same floor as the others. In float32 results.json's `noise_floor` is null and the
evaluations carry none.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from normswap import jsonsafe
from normswap._env import launched_main
from normswap.backends import get_backend
from normswap.checkpoint import target_lock
from normswap.dtypes import parse_dtype
from normswap.errors import (
    NormswapError,
    one_line,
    option_labels,
    option_setting,
    require_bool,
    using_option_names,
)
from normswap.experiment import processes, report
from normswap.experiment.arms import build_arm, check_arms
from normswap.experiment.pretrain import (
    INFO_FILE,
    ONE_TOKEN_PER_BYTE,
    check_pretraining_precision,
    check_pretraining_texts,
    encode,
    ensure_pretrained,
    model_config,
    most_tokens,
    pretrain_dir,
    read_text,
    text_stage,
)
from normswap.experiment.recipe import Recipe, RecipeError, check_seq_len, load_recipe, parse_arm, select_arms
from normswap.experiment.report import count_noun
from normswap.experiment.trainer import (
    Interrupted,
    RandomWindows,
    StopFlag,
    any_process,
    check_resumable,
    check_step_fits,
    check_training_text,
    resolve_mixed_precision,
    train,
)
from normswap.fileio import (
    cannot_make,
    cannot_write,
    made_folders,
    remove_tree,
    sibling_name,
    target_path,
    unwritable,
    write_text_atomic,
)
from normswap.jsonsafe import finite_or_null

if TYPE_CHECKING:
    from normswap.evaluate import DiffResult

RESULT_FILE = "result.json"


@dataclass
class ExperimentResult:
    out: Path
    data: dict  # what results.json holds
    files: dict[str, str]
    model_path: str = ""  # the model the arms were made from, on this machine (results.json keeps no such path)

    @property
    def summary(self) -> list[dict]:
        return report.summary_rows(self.data["arms"])

    def to_dict(self) -> dict:
        return {"out": str(self.out), "files": self.files, "summary": self.summary, **self.data}


def portable_path(path: str, recipe_dir: Path | None) -> str:
    """A local path as results.json records it, so that a committed result names no machine: relative
    to the recipe's folder when inside it, `<normswap cache>/...` inside the cache, `~/...` inside the
    home folder; anything else (a hub id, a relative path) unchanged."""
    from normswap.loading import cache_dir

    if not path or not Path(path).is_absolute():
        return path
    p = Path(path)
    for root, prefix in ((recipe_dir, None), (cache_dir(check=False), "<normswap cache>"), (Path.home(), "~")):
        if root is None:
            continue
        try:
            rel = p.relative_to(Path(root).expanduser().resolve())
        except ValueError:
            continue
        return rel.as_posix() if prefix is None else f"{prefix}/{rel.as_posix()}"
    return path


def portable_result(data: dict, recipe_dir: Path | None) -> dict:
    """`data` (results.json's content) with its paths made portable (see portable_path)."""
    data = json.loads(json.dumps(data))
    sections = [data["recipe"].get(k) for k in ("model", "pretrain", "data")]
    sections.append((data.get("pretrain") or {}).get("section"))
    for section in sections:
        for key, value in (section or {}).items():
            if key in ("path", "text", "train", "eval") and isinstance(value, str):
                section[key] = portable_path(value, recipe_dir)
    if isinstance(data.get("model"), str):
        data["model"] = portable_path(data["model"], recipe_dir)
    return data


def make_accelerator(recipe: Recipe, out: Path):
    """One Accelerator per process (accelerate's state is process-wide), with the recipe's mixed
    precision and tracker."""
    from accelerate import Accelerator

    mp = resolve_mixed_precision(recipe.finetune.mixed_precision)
    tracker = recipe.tracker
    if tracker == "auto":
        tracker = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    if tracker == "tensorboard" and not importlib.util.find_spec("tensorboard"):
        raise RecipeError("tracker: tensorboard is not installed (pip install tensorboard)")
    kwargs = {"mixed_precision": mp}
    if tracker != "none":
        kwargs.update(log_with=tracker, project_dir=str(out / "logs"))
    try:
        return Accelerator(**kwargs)
    except ValueError as e:
        if "already been initialized" not in str(e):
            raise
        # accelerate's "restart your runtime completely": an internal error of a second
        # run_experiment in one Python process with another finetune.mixed_precision
        from accelerate.state import AcceleratorState

        raise RecipeError(f"finetune.mixed_precision: {recipe.finetune.mixed_precision!r} ({mp}), but an earlier "
                          f"run set accelerate up in this process with {AcceleratorState().mixed_precision!r} (it "
                          "keeps one mixed precision per process): run this one in a new process") from None


def _check_out(out: Path, fingerprint: str, arms: list[str], plot: bool = True, recipe: Recipe | None = None,
               digests: dict[str, str] | None = None, force: bool = False) -> bool:
    """OUT is new, empty, or an earlier run of the recipe whose fingerprint() is `fingerprint` (its
    recipe.json, as _run writes it): a run writes
    results.csv, summary.md, curves.png, logs/ and arms/ there, over any user files of those
    names. (logs/ alone: a run stopped before it wrote recipe.json.) And a report or an arm's
    record (of `arms`) that is a link there can be written through (fileio.replaced_atomically;
    curves.png only as `plot` says). recipe, digests: the recipe of `fingerprint` and its
    text_digests(), to say what differs from the run in OUT. force: a run of another recipe is
    replaced (True returned: _replace_out, once the run's checks have passed) when OUT holds
    nothing else (_replaceable)."""
    n = option_labels(EXPERIMENT_OPTIONS)  # as run_experiment installed them
    if out.exists() and not out.is_dir():
        raise NormswapError(f"{out} exists and is not a folder; choose another {n['out']}")
    stamp = out / "recipe.json"
    if out.is_dir() and not stamp.is_file() and any(p.name != "logs" for p in out.iterdir()):
        raise NormswapError(f"{out} holds files and no earlier run of normswap experiment; refusing to write "
                            f"into it (choose a new or empty {n['out']})")
    if stamp.is_file():
        previous = jsonsafe.read_or_refuse(stamp, f"remove {out} or choose another {n['out']}")
        if not isinstance(previous, dict) or previous.get("fingerprint") != fingerprint:
            what = _what_differs(previous, recipe, digests) if recipe is not None and isinstance(previous, dict) \
                else None
            what = what or f"or other {n['overrides']} values"
            # a recipe.json of another shape is not known to be a run's: its folder is not replaced
            if _replaceable(out, force, isinstance(previous, dict) and "fingerprint" in previous):
                return True
            raise NormswapError(f"{out} holds a run of a different recipe ({what}); remove it or choose another "
                                f"{n['out']}{_force_way(out, isinstance(previous, dict) and 'fingerprint' in previous)}")
    # Written through, a link to nothing, to a folder or a pipe, or into a folder this user may not
    # write failed the write: after the pretraining and every arm for a report, after the arm for its
    # record. Found here instead (a plain file or none there is OUT's, checked with OUT; a finished
    # arm's record is read, not written; isfile: False, not PermissionError, behind a folder one may not enter).
    unfinished = (out / "arms" / arm / RESULT_FILE for arm in arms)
    for path in (*(out / name for name in report.report_files(plot)), *(p for p in unfinished if not os.path.isfile(p))):
        if path.is_symlink() and (why := unwritable(path)):
            raise cannot_write(path, why)
    return False


# What a run writes in OUT (report.report_files, curves.png included), and in each arm's folder.
RUN_ENTRIES = ("recipe.json", "results.json", "results.csv", "summary.md", "curves.png", "logs", "arms")
ARM_ENTRIES = (RESULT_FILE, "state")
TRACKER_FILES = "events.out.tfevents."  # what tensorboard's writer names its files in logs/<name>/


def _not_a_runs(out: Path) -> list[str]:
    """What in OUT a run does not write (RUN_ENTRIES; in arms/, folders named as arms holding
    ARM_ENTRIES; the temporary files fileio.replaced_atomically leaves when killed), as paths
    relative to OUT: what force must not replace. A link where a run makes a folder is not its,
    nor a folder where it writes a file (a user's summary.md/ of notes went with the run)."""

    def written(folder: Path, names: tuple[str, ...], folders: tuple[str, ...]) -> list[Path]:
        others = []
        for p in folder.iterdir():
            temporary = any(p.name.startswith(f".{sibling_name(n)}.") and p.name.endswith(".tmp") for n in names)
            a_folder = p.is_dir() and not p.is_symlink()
            if (p.name not in names and not temporary) or a_folder != (p.name in folders):
                others.append(p)
        return others

    others = written(out, RUN_ENTRIES, ("logs", "arms"))
    if (out / "arms").is_dir() and not (out / "arms").is_symlink():
        for arm_dir in (out / "arms").iterdir():
            try:
                parse_arm(arm_dir.name)
            except RecipeError:
                others.append(arm_dir)
                continue
            if arm_dir.is_symlink() or not arm_dir.is_dir():
                others.append(arm_dir)
            else:
                others += written(arm_dir, ARM_ENTRIES, ("state",))
    if (out / "logs").is_dir() and not (out / "logs").is_symlink():
        # The tracker's (tensorboard, the one a recipe can name): a folder per run name holding its
        # event files. A user's own logs/ (a run's stdout redirected there) went with the run.
        for run_dir in (out / "logs").iterdir():
            if run_dir.is_symlink() or not run_dir.is_dir():
                others.append(run_dir)
            else:
                others += [p for p in run_dir.iterdir()
                           if not (p.name.startswith(TRACKER_FILES) and p.is_file() and not p.is_symlink())]
    return sorted(p.relative_to(out).as_posix() for p in others)


def _finished_arms(out: Path) -> list[str]:
    arms = out / "arms"
    return sorted(p.parent.name for p in arms.glob(f"*/{RESULT_FILE}")) if arms.is_dir() else []


def _replaceable(out: Path, force: bool, runs: bool) -> bool:
    """Whether force replaces OUT, a run (`runs`: its recipe.json is one a run writes) refused as
    another's: only when OUT holds nothing a run does not write; refused otherwise, naming it."""
    if not (force and runs):
        return False
    if others := _not_a_runs(out):
        n = option_labels(EXPERIMENT_OPTIONS)
        raise NormswapError(f"{out} holds a run of another recipe and what no run writes ({_some(others)}): not replaced, "
                            f"even with {option_setting(n['force'], True)}; remove it or choose another {n['out']}")
    return True


def _force_way(out: Path, runs: bool) -> str:
    """The last way out of the refusal of an OUT that holds another run (`runs`: its recipe.json is
    one a run writes), after removing it and another OUT: force, saying which finished arms it
    replaces; "" when force would not replace it (_replaceable)."""
    if not runs or _not_a_runs(out):
        return ""
    finished = _finished_arms(out)
    also = f" and the {count_noun(len(finished), 'arm')} finished there ({_some(finished)})" if finished else ""
    return f", or pass {option_setting(option_labels(('force',))['force'], True)} to replace it{also}"


def _some(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _replace_out(out: Path) -> None:
    """Empty OUT, a run of another recipe that force replaces (_not_a_runs found nothing else in it).
    What makes the next run refuse OUT goes last: arms/ first, results.json (the pretraining the
    arms ran on, _check_same_pretraining) once they are gone, recipe.json at the end. A kill on the
    way leaves a run that is still refused as another's (and replaced again with force), or one with
    no finished arm: removed in the folder's order, results.json could go before arms/, and the
    next run resumed the other pretraining's arms beside its own."""
    last = ("arms", "", "results.json", "recipe.json")
    for p in sorted(out.iterdir(), key=lambda p: last.index(p.name if p.name in last else "")):
        if p.is_dir() and not p.is_symlink():
            if error := remove_tree(p):
                raise cannot_write(out, one_line(error))
        else:
            p.unlink()


def _what_differs(previous: dict, recipe: Recipe, digests: dict[str, str], most: int = 3) -> str:
    """What makes the run in OUT (its recipe.json, `previous`) another recipe than `recipe`, as
    `finetune.steps 20 there, 30 here; data.eval: its text has changed`: the refusal said only "a
    different recipe (or other --set values)", also to a user who had changed neither but edited a
    text the recipe names, and left finding the difference to them. "" when it cannot be told."""
    before = previous.get("recipe")
    if not isinstance(before, dict):
        return ""

    def flat(d: dict, prefix: str = "") -> dict:
        return {k: v for key, value in d.items()
                for k, v in (flat(value, f"{prefix}{key}.").items() if isinstance(value, dict)
                             else [(f"{prefix}{key}", value)])}

    then, now = flat(before), flat(recipe.to_dict())
    texts = recipe.texts_by_key(digests)
    recorded = previous.get("texts") if isinstance(previous.get("texts"), dict) else {}
    said = []
    for key in dict.fromkeys([*now, *then]):
        if key in ("arms", "description", "tracker"):  # not part of the fingerprint
            continue
        if key in texts and key in recorded:  # by content, as the fingerprint takes it (a moved file is the same)
            if recorded[key] != texts[key]:
                said.append(f"{key}: its text has changed")
        elif then.get(key, "unset") != now.get(key, "unset") and key not in texts:
            said.append(f"{key} {json.dumps(then.get(key, 'unset'))} there, {json.dumps(now.get(key, 'unset'))} here")
    if not said and not recorded and texts:  # a recipe.json from before the texts were recorded
        return f"the same keys: a text it names has changed ({', '.join(texts)})"
    return "; ".join(said[:most]) + (f"; and {len(said) - most} more" if len(said) > most else "")


def _load_model(path: str, progress: bool):
    from normswap.loading import load_config, load_model, load_tokenizer, resolve

    source = resolve(path, progress=progress)
    config = load_config(source, progress)  # a .gguf's read takes seconds: a stage, as in every command
    return load_model(source, dtype=torch.float32, config=config), load_tokenizer(source, progress)


def _dtype_name(dtype: str) -> str:
    return str(parse_dtype(dtype)).removeprefix("torch.")


def _floor_section(floor: DiffResult | None, dtype: str) -> dict | None:
    """results.json's `noise_floor`: the half original's distance from the float32 original."""
    from normswap.evaluate import NOISE_KL_FACTOR, Distance, describe_floor

    if floor is None:
        return None
    original = Distance.of(floor.to_dict())
    return {"dtype": _dtype_name(dtype), "ppl_reference": floor.ppl_a, "original": asdict(original),
            "limit": NOISE_KL_FACTOR, "description": describe_floor(_dtype_name(dtype), original)}


def _eval_distance(e: dict, ppl_reference: float) -> dict:
    """An evaluation (the arm's perplexity; KL and top-1 against the float32 original) as its
    distance from the float32 original, in normswap.evaluate.Distance's fields."""
    return {"delta_ppl": e["ppl"] - ppl_reference, "relative_delta": (e["ppl"] - ppl_reference) / ppl_reference,
            "kl_mean": e["kl_mean"], "kl_max": e["kl_max"], "top1_agreement": e["top1_agreement"]}


def _judged(arms: dict[str, dict], floor: DiffResult | None, dtype: str) -> dict[str, dict]:
    """`arms` with every evaluation judged against the half-precision noise floor (a copy; `arms`
    itself, as each arm's result.json holds it, is left alone). Unchanged without a floor."""
    from normswap.evaluate import judge_noise

    if floor is None:
        return arms
    out = json.loads(json.dumps(arms))
    original = floor.to_dict()
    for name, arm in out.items():
        for e in arm["evals"]:
            noise = judge_noise(original, _eval_distance(e, floor.ppl_a), _dtype_name(dtype), floor.ppl_a,
                                name=f"the {name} arm")
            e["noise_floor"] = {"kl_ratio": noise.kl_ratio, "within": noise.within, "verdict": noise.verdict}
    return out


def run_experiment(recipe: Recipe | str | os.PathLike, out: str | Path | None = None,
                   arms: str | Sequence[str] | None = None, *, overrides: Sequence[str] = (),
                   progress: bool = True, stop: StopFlag | None = None, accelerator=None, plot: bool = True,
                   on_step: Callable[[str, int, float], None] | None = None,
                   option_names: Mapping[str, str] | None = None, force: bool = False) -> ExperimentResult:
    """Run (or resume) every arm of `recipe` (or the `arms` subset: a list or "a,b"), write the
    reports into `out` (default: recipe.default_out(), runs/<name>). The reports cover every arm
    finished in `out`: those run now and those an earlier call finished there (with other `arms`).
    recipe: a validated Recipe, or the path of a TOML recipe, read with load_recipe(recipe,
    overrides) (`key=value`, dotted: what `--set` gives); overrides need a path (a Recipe is
    already validated: dataclasses.replace it).
    option_names: what error messages call arms, out and overrides (the command line's {"arms": "--arms",
    ...}), here and in everything the run calls.

    stop: a StopFlag; once set (Ctrl-C, SIGTERM, or a caller) the running arm checkpoints and Interrupted is
    raised; the same call again resumes. on_step(arm, step, loss) runs after every training step.
    force: an `out` that holds a run of another recipe (or one on another pretraining: refused
    otherwise) is replaced, its finished arms too, when it holds nothing but what a run writes; the
    same recipe's run is resumed, force or not (a finished arm is deterministic: delete its folder to run it again)."""
    with using_option_names(option_labels(EXPERIMENT_OPTIONS, option_names) | EVAL_WINDOW_KEYS):
        return _run_experiment(recipe, out, arms, overrides, progress, stop, accelerator, plot, on_step, force)


# The options run_experiment's messages name, as option_names renames them.
EXPERIMENT_OPTIONS = ("arms", "out", "overrides", "force")
# The evaluation's text and window options (diff_models' parameters, _eval_windows) by the recipe
# keys they come from: its messages said `pass max_length 54 or less` and `max_tokens 20 is shorter
# than one window` to a user who wrote data.eval_max_length and data.eval_max_tokens, and `the
# text is shorter than one window` of data.eval (also the pretraining's held-out text). Every
# caller writes these keys, so option_names does not rename them.
EVAL_WINDOW_KEYS = {"data": "data.eval", "max_length": "data.eval_max_length", "stride": "data.eval_stride",
                    "max_tokens": "data.eval_max_tokens", "batch_size": "data.eval_batch_size"}


def _checked_arguments(recipe, out, arms, overrides, on_step, force) -> tuple[Path, Recipe, list[str]]:
    """run_experiment's arguments checked: OUT as a path, the recipe read, the arms selected."""
    require_bool("force", force)
    if not isinstance(recipe, Recipe):  # read first: a bad recipe is reported before a missing extra
        recipe = load_recipe(recipe, overrides)
    elif overrides:
        raise TypeError("overrides apply to a recipe file; a Recipe is already validated (dataclasses.replace it)")
    arms = select_arms(recipe, arms, option_labels(("arms",))["arms"])
    get_backend(recipe.impl)  # an impl that cannot run here: refused now, not after pretraining at the first arm
    if out is not None and not isinstance(out, str | os.PathLike):
        raise TypeError(f"out: expected a folder path (str or path), got {type(out).__name__}")
    if on_step is not None and not callable(on_step):  # else found at the first step, after the arms before it
        raise TypeError(f"on_step: expected a function (arm, step, loss), got {type(on_step).__name__}")
    out = target_path(out if out is not None else recipe.default_out(), "folder")  # "" (an unset $OUT) refused
    return out, recipe, arms


def _run_experiment(recipe, out, arms, overrides, progress, stop, accelerator, plot, on_step,
                    force) -> ExperimentResult:
    with contextlib.ExitStack() as held:
        if accelerator is None:
            held.enter_context(processes.joined())
        # Every process checks; the main one alone takes the locks and makes OUT. A refusal any of
        # them reaches is every one's (processes.together), before the run's first barrier.
        with processes.together():
            out, recipe, arms = _checked_arguments(recipe, out, arms, overrides, on_step, force)
            run = _checked_run(recipe, out, arms, held, progress=progress, plot=plot, accelerator=accelerator,
                               force=force)
        return _run(recipe, out, arms, *run, progress=progress, stop=stop, plot=plot, on_step=on_step)


def _take_out(out: Path, accelerator, held: contextlib.ExitStack) -> None:
    """OUT's lock (the main process's), and the folders above OUT made, in `held`."""
    if _is_main_process(accelerator):
        # An OUT that cannot be written is said as patch and convert say theirs, not as the lock
        # file beside it ("cannot create the lock file ...") or a folder on the way that failed.
        if why := unwritable(out, folder=True):
            raise cannot_write(out, why)
        # Two runs writing one OUT would train an arm into one state folder, each removing the
        # other's checkpoints, and write each other's reports: the second is refused at once,
        # by the lock beside OUT that patch and convert take for --out.
        try:
            held.enter_context(made_folders(out.parent))
        except OSError as e:
            raise cannot_make(out, e) from None
        held.enter_context(target_lock(out))


def _shown(progress: bool, accelerator) -> bool:
    """Whether this process draws progress: the main one, as in every stage of a launched run."""
    return progress and _is_main_process(accelerator)


def _is_main_process(accelerator) -> bool:
    """Before an Accelerator exists, the rank a launcher (accelerate launch, torchrun) gave this process."""
    if accelerator is not None:
        return accelerator.is_main_process
    return launched_main()


def _checked_run(recipe: Recipe, out: Path, arms: list[str], held: contextlib.ExitStack, *, progress, plot,
                 accelerator, force) -> tuple:
    """What can be checked before OUT is made, OUT locked and made (its lock, the pretraining's and
    OUT's removal if the run fails before writing there go into `held`), the Accelerator made:
    _run's arguments after `arms`."""
    _take_out(out, accelerator, held)
    # Every text's digest, once for the run: the fingerprint (checked here, recorded in recipe.json
    # and results.json) and the pretraining's cache entry (looked up here, then by the pretraining)
    # took each again, a read of the whole file each time (0.36 s per 100 MB here).
    digests = recipe.text_digests()
    replacing = _check_out(out, recipe.fingerprint(digests), arms, plot, recipe, digests, force)
    if recipe.pretrain is not None and not replacing:
        replacing = _check_same_pretraining(out, pretrain_dir(recipe.pretrain, recipe.seed, recipe.name,
                                                              digests[recipe.pretrain.text]), force)
    _warn_if_not_held_out(recipe, arms, digests)
    # A training step too large for the machine, from the sizes alone: refused before the pretraining
    # and the arms before the first that trains
    for name, section in (("pretrain", recipe.pretrain),
                          ("finetune", recipe.finetune if any(parse_arm(a)[1] for a in arms) else None)):
        if section is not None:
            try:
                check_step_fits(section.batch_size * section.grad_accum, section.seq_len)
            except NormswapError as e:
                raise NormswapError(f"{name}: {e}") from None
    loaded = train_ids = None
    # Bad texts, and arms the model cannot make, are refused here, before OUT is made: found when
    # an arm needs them, they would stop the run after pretraining and the arms before it.
    texts = _read_texts(recipe, arms)
    if recipe.pretrain is None:  # a model that does not load or fit is reported before OUT is made
        loaded = _load_model(recipe.model.path, progress)
        _check_fits(recipe, loaded[0])
        check_arms(loaded[0], arms)
        from normswap.evaluate import check_before_loading
        from normswap.loading import model_class

        # what the first evaluation would refuse (no language-model head, an encoder-decoder, ...)
        check_before_loading([loaded[0].config], loaded[1], texts["eval"], **_eval_windows(recipe),
                             model_class=model_class)
        if "train" in texts:
            windows = _train_windows(recipe, loaded[1], texts["train"], _shown(progress, accelerator))
            try:  # step 1's batch: a size that cannot be allocated fails here, not after the arms before it
                windows.micro_batches(0, 0, 1, recipe.finetune.grad_accum)
            except NormswapError as e:
                raise NormswapError(f"finetune: {e}") from None
            train_ids = windows.ids
    pretraining = contextlib.ExitStack()  # the pretraining's cache entry, locked until it is trained
    if recipe.pretrain is not None:
        final = _check_before_pretraining(recipe, texts, digests, accelerator)
        if final is not None and _is_main_process(accelerator):
            # Another run pretraining this entry (two --out folders sharing a [pretrain] section) was
            # found by ensure_pretrained, after OUT/recipe.json: the refused run left OUT behind, a
            # run of nothing that a rerun with another recipe was then refused for. Taken here, before
            # OUT is made; ensure_pretrained takes it again (re-entrant) and _run lets it go once
            # the model is trained, not at the end of the arms.
            final.parent.mkdir(parents=True, exist_ok=True)
            pretraining.enter_context(target_lock(final.resolve()))
    held.enter_context(pretraining)
    # OUT and the folders above it that this run makes go again if it fails before writing there
    held.enter_context(made_folders(out))
    accelerator = accelerator or make_accelerator(recipe, out)
    # An arm left part-trained by a run with another process count is refused now, not after the
    # pretraining and the arms before it. (A finished arm is reused whatever count ran it: its
    # result.json records the count, and the summary says which arms ran on which.)
    for arm in arms if not replacing else ():  # (a replaced run's checkpoints go)
        arm_dir = out / "arms" / arm
        if parse_arm(arm)[1] and not (arm_dir / RESULT_FILE).is_file():
            check_resumable(arm_dir / "state", accelerator.num_processes, arm)
    return loaded, texts, train_ids, digests, accelerator, pretraining, replacing


def _check_same_pretraining(out: Path, entry: Path, force: bool = False) -> bool:
    """OUT's earlier arms (results.json's `model`) ran on the pretraining this run uses, `entry`, or
    the run is refused. The fingerprint does not tell: pretrain.mixed_precision "auto" is keyed by
    what it is on the machine (pretrain.cache_key), so an OUT made on a CPU and resumed on a GPU, or
    made on a GPU before "auto" was keyed so, pretrained anew, and its new arms were reported beside
    the earlier ones, each compared with another model's numbers. An OUT with no finished arm has
    nothing to mix with. force: such an OUT is replaced (True returned), as _check_out replaces one."""
    try:  # only a guard: a results.json that cannot be read is rewritten by the run, as before
        recorded = jsonsafe.read(out / "results.json").get("model")
    except (OSError, ValueError, AttributeError):
        return False
    if isinstance(recorded, str) and recorded and Path(recorded).name != entry.name:
        if _replaceable(out, force, True):
            return True
        raise NormswapError(f"{out} holds arms run on the pretrained model {recorded}, and this run's is "
                            f"{entry.name} (pretrain.mixed_precision \"auto\" is keyed by what it is on the "
                            f"machine): its arms would be reported beside them on other weights; remove {out} "
                            f"or choose another {option_labels(('out',))['out']}{_force_way(out, True)}")
    return False


def _warn_if_not_held_out(recipe: Recipe, arms: list[str], digests: dict[str, str]) -> None:
    """data.eval is the held-out text: the reports call its perplexity held-out, and the recovered
    share compares arms by it. The very text a model trained on (pretrain.text; data.train when an
    arm trains) scores how well it learnt that text, not what it does on text it has not seen: a
    recipe that names it twice ran without a word. Said (by content: a copy under another name too),
    and run: measuring the fit is a choice one may make."""
    eval_digest = digests[recipe.data.eval]
    trained_on = [key for key, path in (("pretrain.text", recipe.pretrain and recipe.pretrain.text),
                                        ("data.train", any(parse_arm(a)[1] for a in arms) and recipe.data.train))
                  if path and digests[path] == eval_digest]
    if trained_on:
        warnings.warn(f"data.eval is the same text as {' and '.join(trained_on)}: its perplexity is not held out "
                      "(the reports call it so), it measures how well the models fit the text they trained on",
                      stacklevel=2)


def _check_before_pretraining(recipe: Recipe, texts: dict[str, str], digests: dict[str, str],
                              accelerator) -> Path | None:
    """With [pretrain], the tokenizer is trained with the model, so what the texts' token counts
    decide (a held-out text shorter than a window, a training text shorter than a sequence) was
    found only after the pretraining, minutes to hours in. Found here instead where it is certain:
    the window options against each other and pretrain.context, the texts by the most tokens the
    tokenizer can make of them (pretrain.most_tokens). The counts between that bound and what the
    windows need are still checked once the tokenizer exists (_run, as in every scoring). Returns
    the cache entry the pretraining will train; None when it is trained already."""
    p = recipe.pretrain
    # Each text's bound counted once (an encode of the whole text; pretrain.text's shared with
    # data.train when they are one file): the checks below and the pretraining's share them.
    most = {key: most_tokens(text) for key, text in texts.items()}
    final = pretrain_dir(p, recipe.seed, recipe.name, digests[p.text])
    pretraining = not (final / INFO_FILE).is_file()  # a cached one is not trained again
    if pretraining:
        # Read once (a large text is seconds a read): _run hands it to the pretraining. The shipped
        # recipes pretrain on their data.train, which _read_texts has read when an arm trains.
        same = "train" in texts and Path(p.text) == Path(recipe.data.train)
        # (the run's precision as make_accelerator will choose it, or a caller's accelerator's)
        check_pretraining_precision(p, accelerator.mixed_precision if accelerator is not None
                                    else resolve_mixed_precision(recipe.finetune.mixed_precision))
        texts["pretrain"] = texts["train"] if same else read_text(p.text)
        check_pretraining_texts(p, most["train"] if same else most_tokens(texts["pretrain"]), most["eval"])
    from normswap.evaluate import check_before_tokenizing

    check_before_tokenizing([model_config(p, p.vocab_size, 0)], most["eval"], ONE_TOKEN_PER_BYTE,
                            **_eval_windows(recipe))
    if "train" in texts:
        try:
            check_training_text(most["train"], recipe.finetune.seq_len, ONE_TOKEN_PER_BYTE)
        except NormswapError as e:
            raise NormswapError(f"data.train: {e}") from None
    return final if pretraining else None


def _check_fits(recipe: Recipe, model) -> None:
    """finetune.seq_len within the model's context, read as the evaluation reads it
    (normswap.inputs.context_length: every family's name for it, the text config's first)."""
    from normswap.inputs import context_length

    check_seq_len(recipe.finetune.seq_len, context_length(getattr(model, "config", None)))


def _eval_windows(recipe: Recipe) -> dict:
    """The evaluation's window options, as diff_models takes them (EVAL_WINDOW_KEYS: their keys)."""
    d = recipe.data
    return {"max_length": d.eval_max_length, "stride": d.eval_stride or None, "max_tokens": d.eval_max_tokens,
            "batch_size": d.eval_batch_size}


def _read_texts(recipe: Recipe, arms: list[str]) -> dict[str, str]:
    """The held-out text, and the training text when an arm trains (NormswapError naming the file
    when one is empty, binary, not UTF-8, ...)."""
    texts = {}
    for key in ("eval", "train") if any(parse_arm(a)[1] for a in arms) else ("eval",):
        try:
            texts[key] = read_text(getattr(recipe.data, key))
        except NormswapError as e:
            raise NormswapError(f"data.{key}: {e}") from None
    return texts


def _train_windows(recipe: Recipe, tokenizer, text: str, progress: bool, ids: torch.Tensor | None = None
                   ) -> RandomWindows:
    """The fine-tuning's batches of data.train (`text`), its token ids `ids` when already encoded."""
    ft = recipe.finetune
    try:
        if ids is None:
            with text_stage("tokenize data.train", text, progress):
                ids = encode(tokenizer, text)
        return RandomWindows(ids, ft.seq_len, ft.batch_size, recipe.seed)
    except NormswapError as e:
        raise NormswapError(f"data.train: {e}") from None


def _read_arm_result(done: Path, arm: str) -> dict:
    """An arm's result.json, as a finished arm left it (NormswapError naming it when malformed)."""
    result = jsonsafe.read_or_refuse(done, f"delete it to run the arm {arm} again")
    # The reports read every evaluation's step and metrics and the losses: a file without them (a
    # user's {}, an arm folder copied from elsewhere) was an internal error after this run's arms.
    evals = result.get("evals") if isinstance(result, dict) else None
    if not (isinstance(evals, list) and evals and isinstance(result.get("losses", []), list)
            and all(isinstance(e, dict) and type(e.get("step")) is int and all(m in e for m in report.METRICS)
                    for e in evals)):
        raise NormswapError(f"{done}: not an arm result (a JSON object with its evaluations, each with a step and "
                            f"{', '.join(report.METRICS)}); delete it to run the arm {arm} again")
    return result


def _with_earlier_arms(results: dict[str, dict], out: Path, recipe: Recipe) -> dict[str, dict]:
    """The arms this invocation ran, plus every arm an earlier invocation finished in OUT (with
    another --arms: OUT is one run of the recipe, whose arm selection is not part of it), in the
    recipe's order, then this invocation's, then by name. Without them a run made arm by arm
    (`--arms original`, then `--arms approx+ft`) would report only its last arm, and its Δ and
    recovered columns, which need `original` and `original+ft`, would be empty."""
    finished = dict(results)
    for arm_dir in sorted((out / "arms").iterdir()) if (out / "arms").is_dir() else ():
        done = arm_dir / RESULT_FILE
        if arm_dir.name in finished or not done.is_file():
            continue
        try:
            parse_arm(arm_dir.name)
        except RecipeError:  # not an arm's folder (a user's, or a stray one): not part of the run
            continue
        finished[arm_dir.name] = _read_arm_result(done, arm_dir.name)
    order = list(dict.fromkeys([*recipe.arms, *results, *finished]))
    return {arm: finished[arm] for arm in order if arm in finished}


def _run(recipe: Recipe, out: Path, arms: list[str], loaded, texts: dict[str, str], train_ids,
         digests: dict[str, str], accelerator, pretraining: contextlib.ExitStack, replacing: bool, *, progress,
         stop, plot, on_step) -> ExperimentResult:
    """run_experiment once OUT is checked (and made): `loaded`, the (model, tokenizer) of [model];
    `texts`, what _read_texts read; `train_ids`, the training text's tokens when already encoded;
    `digests`, the recipe's text_digests(); `pretraining`, the pretraining's lock (let go once it is done);
    `replacing`, whether OUT holds another run that force replaces (now that every check has passed).
    What the main process does alone is done together (processes.together): its failure is every process's."""
    from accelerate.utils import set_seed

    from normswap.evaluate import HALF_DTYPES, diff_models
    from normswap.progress import stderr_bar

    with processes.together():
        if accelerator.is_main_process:
            if replacing:
                _replace_out(out)
            # through a temporary file: a rerun on a full disk must not leave the record of the run truncated
            # texts: each text's digest by its key, to say which changed when a rerun is refused (_what_differs)
            write_text_atomic(out / "recipe.json", json.dumps({"fingerprint": recipe.fingerprint(digests),
                                                              "source": recipe.source, "recipe": recipe.to_dict(),
                                                              "texts": recipe.texts_by_key(digests)}, indent=1))
    if accelerator.trackers == [] and accelerator.log_with:
        accelerator.init_trackers(recipe.name)
    stop = stop or StopFlag()
    started = time.perf_counter()
    pretrain_info = None
    if recipe.pretrain is not None:
        set_seed(recipe.seed)
        # The tokens of pretrain.text, when the pretraining runs; data.train's when it is the same text
        # (the shipped recipes'): a first run tokenized it twice, as many seconds again for a large text.
        pretrained_tokens: dict[str, torch.Tensor] = {}
        same = "pretrain" in texts and "train" in texts and texts["pretrain"] == texts["train"]
        # popped: the text (as large as the pretraining's) is not held through the arms
        model_dir, pretrain_info = ensure_pretrained(accelerator, recipe.pretrain, recipe.seed, recipe.name,
                                                     texts["eval"], text=texts.pop("pretrain", None),
                                                     text_digest=digests[recipe.pretrain.text], stop=stop,
                                                     progress=progress, tokens=pretrained_tokens)
        if same and "text" in pretrained_tokens:
            train_ids = pretrained_tokens["text"]
        pretraining.close()  # trained: another run may use the entry while this one's arms run
        model_path = str(model_dir)
    else:
        model_path = recipe.model.path
    ft = recipe.finetune
    d = recipe.data
    shown = progress and accelerator.is_main_process
    windows = _eval_windows(recipe)
    floor = None
    with processes.together():
        if recipe.pretrain is not None:
            loaded = _load_model(model_path, progress)
            _check_fits(recipe, loaded[0])
        original, tokenizer = loaded
        original.to(accelerator.device)
        with text_stage("tokenize data.eval", texts["eval"], shown):
            eval_ids = encode(tokenizer, texts["eval"])
        if recipe.pretrain is not None and "train" in texts:
            # With [pretrain] the tokenizer exists only now: a training text long enough in bytes but
            # not in tokens (what _check_before_pretraining cannot tell) is refused here, not when the
            # first arm that trains begins, after the arms before it have run.
            train_ids = _train_windows(recipe, tokenizer, texts["train"], shown, train_ids).ids
        if parse_dtype(ft.dtype) in HALF_DTYPES and accelerator.is_main_process:
            # The original arm's model in the half dtype, against its float32 self: once, not at every eval.
            half_original = build_arm(original, "original", recipe.impl, ft.dtype)
            floor = diff_models(original, half_original, tokenizer, eval_ids, progress=False, **windows)
            del half_original

    def evaluate(model, step: int) -> dict:
        r = diff_models(original, model, tokenizer, eval_ids, progress=False, **windows)
        evaluate.window = {"tokens": r.tokens, "max_length": r.max_length, "stride": r.stride}
        return {"ppl": r.ppl_b, "nll": r.nll_b, "kl_mean": r.kl_mean, "kl_max": r.kl_max,
                "top1_agreement": r.top1_agreement}

    evaluate.window = None
    results: dict[str, dict] = {}
    for i, arm in enumerate(arms):
        arm_dir = out / "arms" / arm
        done = arm_dir / RESULT_FILE
        if done.is_file():
            with processes.together():
                results[arm] = _read_arm_result(done, arm)
            if progress and accelerator.is_main_process:  # else a rerun of a finished run said nothing at all
                print(f"[{i + 1}/{len(arms)}] {arm}: finished by an earlier run (delete {arm_dir} to run it again)",
                      file=sys.stderr)
            continue
        # A Ctrl-C or SIGTERM during an evaluation (or a pretraining's held-out scoring, or an arm's
        # last step) stops here: training checks only after its steps, so an arm that only
        # evaluates ran on, and a run whose remaining arms only evaluate ignored the signal.
        if any_process(accelerator, stop.is_set()):
            raise Interrupted(f"stopped before [{i + 1}/{len(arms)}] {arm}; run the same command again to resume")
        transform, training = parse_arm(arm)
        set_seed(recipe.seed)
        with processes.together():
            model = build_arm(original, arm, recipe.impl, ft.dtype)
        arm_started = time.perf_counter()
        desc = f"[{i + 1}/{len(arms)}] {arm}"
        if training is None:
            # A bar for the evaluation too: an arm that does not train was seconds with nothing shown.
            with stderr_bar(total=1, desc=desc, unit="eval", disable=not (progress and accelerator.is_main_process)) \
                    as bar, processes.together():
                evals = [{"step": 0, **evaluate(model, 0)}] if accelerator.is_main_process else []
                bar.update(1)
            history = {"steps": 0, "losses": [], "evals": evals, "train_seconds": 0.0}
        else:
            batches = (RandomWindows(train_ids, ft.seq_len, ft.batch_size, recipe.seed) if train_ids is not None
                       else _train_windows(recipe, tokenizer, texts["train"], shown))
            train_ids = batches.ids
            teacher = original if training == "distill" else None
            h = train(accelerator, model, ft, batches, arm_dir / "state",
                      loss="distill" if training == "distill" else "lm", teacher=teacher, evaluate=evaluate,
                      eval_every=ft.eval_every, stop=stop, progress=progress, desc=desc, log_prefix=f"{arm}/",
                      on_step=(lambda s, loss, arm=arm: on_step(arm, s, loss)) if on_step else None)
            history = {"steps": h.step, "losses": h.losses, "evals": h.evals, "train_seconds": h.train_seconds}
        with processes.together():
            if accelerator.is_main_process:
                result = {"transform": transform, "training": training, **history,
                          "wall_seconds": time.perf_counter() - arm_started}
                if training:  # its sequences per step: OUT's arms may come from calls launched differently
                    result["num_processes"] = accelerator.num_processes
                if evaluate.window:
                    result["eval_window"] = evaluate.window
                write_text_atomic(done, json.dumps(finite_or_null(result)))
                shutil.rmtree(arm_dir / "state", ignore_errors=True)
                results[arm] = result
        del model
    data, files = {}, {}
    with processes.together():
        if accelerator.is_main_process:
            from normswap.loading import unused_tensors_of

            recipe_dir = Path(recipe.source).parent if recipe.source else None
            results = _with_earlier_arms(results, out, recipe)
            window = next((a["eval_window"] for a in results.values() if a.get("eval_window")), None)
            data = {
                "recipe": recipe.to_dict(),
                "fingerprint": recipe.fingerprint(digests),
                "model": model_path,
                # what the model's load dropped that cannot change what it computes (a head it was saved
                # with, an old masked_bias): said by every other command's report, and the arms were made
                # without them. Named as the model path is (portable_path), no machine's path in the note.
                "unused_tensors": [replace(u, model=portable_path(u.model, recipe_dir)).to_dict()
                                   for u in unused_tensors_of(original)],
                "pretrain": pretrain_info,
                "eval": window or {"tokens": None, "max_length": d.eval_max_length, "stride": d.eval_stride},
                "noise_floor": _floor_section(floor, ft.dtype),
                "arms": _judged(results, floor, ft.dtype),
                "environment": {"torch": torch.__version__, "python": platform.python_version(),
                                "device": str(accelerator.device), "num_processes": accelerator.num_processes,
                                "mixed_precision": accelerator.mixed_precision,
                                "dtype": _dtype_name(ft.dtype)},
                "seconds_this_invocation": round(time.perf_counter() - started, 1),
            }
            data = portable_result(data, recipe_dir)
            files = report.write_reports(data, out, plot=plot)
    accelerator.end_training()  # flushes and closes the trackers (TensorBoard event files)
    return ExperimentResult(out=out, data=data, files=files, model_path=str(model_path))
