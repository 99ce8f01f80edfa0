"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton, and importing a
transformers model class imports triton, so it is decided here, before any test module loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No user launch table (normswap tune's, in ~/.cache): the tests run on the committed table and the
# heuristics wherever they run; tests/test_launch_table.py sets it where it tests the user table.
os.environ.setdefault("NORMSWAP_LAUNCH_TABLE", "off")

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
