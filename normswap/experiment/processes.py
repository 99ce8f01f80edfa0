"""The processes of a launch (`accelerate launch`, torchrun) failing together.

Every process of `accelerate launch -m normswap experiment` runs the whole command, and some work is
the main process's alone: it takes OUT's lock and the pretraining's, writes the records and the
reports, evaluates. A failure there (OUT locked by another run, a full disk) ended the main process
while the others went on into the next collective (the process group's start, a barrier) and waited
for it: the launcher's SIGTERM is handled only once a blocked call returns, so they were killed 30 s
later. So such work is done `together()`: at the block's end every process says what failed in it
(one exchange, which is also the barrier), and if anything did, every process raises: the main one
its own error or the first other's, the others EveryProcessError, which the command line leaves
unsaid (the main process says it: the line came once per process).

One process (no launcher): no exchange, the block's error as it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from normswap.errors import EveryProcessError, NormswapError, one_line


def launched() -> bool:
    """Whether a launcher started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


@contextlib.contextmanager
def joined() -> Iterator[None]:
    """Join the launch's process group now, before anything that may fail (a process that failed
    before joining left the others waiting for it in the group's start), and leave it when the
    block fails, as accelerate's end_training leaves it when a run ends: a process that exited with
    it held could abort in its exit ("terminate called without an active exception", gloo's threads
    still running). Nothing without a launcher, or when the group exists already (a caller's)."""
    import torch.distributed as dist

    if not launched() or (dist.is_available() and dist.is_initialized()):
        yield
        return
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # The group an Accelerator made later takes over (accelerate's state is shared), made as it would
    # make it: on the CPU when the launch says so (else, with no GPU, each process ran alone).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    try:
        yield
    except BaseException:
        state.destroy_process_group()
        raise


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _said(error: BaseException) -> tuple[bool, str]:
    """(whether it is bad input, its line), as the command line says an error."""
    if isinstance(error, NormswapError | OSError):
        return True, one_line(error)
    return False, f"{error.__class__.__name__}: {one_line(error)}"


def agree(error: BaseException | None) -> None:
    """Every process calls it once at the same point, with what failed on it (None: nothing). When
    something failed on any process, raises on every one (see the module's doc); returns otherwise."""
    if _world() == 1:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    said: list = [None] * _world()
    dist.all_gather_object(said, None if error is None else _said(error))
    failed = [(rank, s) for rank, s in enumerate(said) if s is not None]
    if not failed:
        return
    rank = dist.get_rank()
    if rank != 0:
        # the main process says it; a process of its own failure keeps it as the cause
        raise EveryProcessError(failed[0][1][1]) from error
    if error is not None:
        raise error
    other, (bad_input, line) = failed[0]
    if bad_input:
        raise NormswapError(line)
    raise RuntimeError(f"process {other}: {line}")


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Run the block on every process; an exception in it on any process is raised on every one at
    its end (agree). Nothing in the block may wait for another process: one that failed before
    would never come."""
    try:
        yield
    except Exception as e:
        agree(e)
        raise
    agree(None)
