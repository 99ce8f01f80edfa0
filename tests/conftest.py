"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton, and importing a
transformers model class imports triton, so it is decided here, before any test module loads."""

import os
import signal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No user launch table (normswap tune's, in ~/.cache): the tests run on the committed table and the
# heuristics wherever they run; tests/test_launch_table.py sets it where it tests the user table.
os.environ.setdefault("NORMSWAP_LAUNCH_TABLE", "off")
# Ctrl-C as a Python program in a shell's foreground has it (KeyboardInterrupt). A suite started in
# the background (`pytest &`, nohup) inherits SIGINT ignored, and every test of what a second Ctrl-C
# does failed there (DID NOT RAISE KeyboardInterrupt): StopFlag and the path lock rightly hand the
# signal back to the handler they found.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def small_probes(monkeypatch):
    """The CLI's numeric proof is tested elsewhere; small probes keep runs of whole commands quick."""
    from normswap import verify

    monkeypatch.setattr(verify, "DEFAULT_PROBE", verify.ProbeConfig(elements=4096))
