"""Patch a model's norms with normswap's fused kernels, check the proof, save, and load it back.

    python examples/patch_model.py [MODEL] [OUT_DIR]

MODEL defaults to the embedded SmolLM2-135M; OUT_DIR to ./<MODEL's name>-patched. On a CPU machine the
Triton kernels run in the interpreter (slow, but the same code and the same numerics checks).
"""

import sys
from pathlib import Path

import torch

import normswap  # before transformers: switches the Triton interpreter on when there is no GPU
from normswap.checkpoint import save_patched
from normswap.loading import DEFAULT_MODEL, load_model, resolve

model_ref = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
# The model's own name: a folder's real name ("." included), a hub id's last part; only a .gguf
# file's suffix goes (a stem would cut "Qwen2.5-0.5B" at its first dot).
named = Path(model_ref).expanduser()
out_dir = sys.argv[2] if len(sys.argv) > 2 else (
    f"{(named.resolve() if named.exists() else named).name.removesuffix('.gguf')}-patched")

source = resolve(model_ref)
model = load_model(source, dtype=torch.bfloat16)

# Swap every recognised norm in place; each one is verified before patch() returns, and a failure
# undoes the whole call (normswap.VerificationError, its .report attached). A filter_fn(module, path)
# that returns False leaves that norm alone.
report = normswap.patch(model, impl="triton")
worst = max(report.patched, key=lambda e: e.check.max_err_replacement)
print(f"{len(report.patched)} norms patched; worst module {worst.path}: "
      f"error vs float64 {worst.check.max_err_replacement:.3g} (original {worst.check.max_err_original:.3g})")
print(f"whole model: max |Δlogits| {report.model_check.max_abs_diff:.3g}")

# A stock checkpoint (original classes and keys) plus normswap.json; written beside the target,
# reloaded and checked, then moved into place.
save_patched(model, report, out_dir, source=source, replace=True)

# Stock transformers loads it as it was; normswap.load re-applies the patch from the manifest.
again = normswap.load(out_dir)
last = again.get_submodule(report.patched[-1].path)  # e.g. Llama's model.norm, GPT-2's transformer.ln_f
print(type(last).__name__, last)

normswap.revert(again)  # back to the original classes, same Parameters
print(type(again.get_submodule(report.patched[-1].path)).__name__)
