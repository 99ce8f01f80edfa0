"""Perplexity of a model, and how much patching its norms changes it.

    python examples/perplexity.py [MODEL] [PATH]

MODEL defaults to the embedded SmolLM2-135M, PATH to the Genesis text shipped with normswap.
"""

import sys
from pathlib import Path

import normswap  # noqa: F401  (switches on the Triton interpreter when there is no GPU)
from normswap.data import open_corpus
from normswap.errors import NormswapError
from normswap.evaluate import diff_models, patched_copy, perplexity
from normswap.loading import DEFAULT_MODEL, load_model, load_tokenizer, resolve

model_ref = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
path = sys.argv[2] if len(sys.argv) > 2 else Path(normswap.__file__).parent / "data" / "genesis-kjv.txt"

source = resolve(model_ref)
model, tokenizer = load_model(source), load_tokenizer(source)
corpus = open_corpus(path)  # a str would be scored as the text itself: pass PATHs through open_corpus

result = perplexity(model, tokenizer, corpus, max_length=256, max_tokens=512)
print(f"{model_ref}: perplexity {result.ppl:.3f} on {result.tokens} tokens ({result.windows} windows)")

try:
    diff = diff_models(model, patched_copy(model, "triton"), tokenizer, corpus, max_length=256, max_tokens=512)
except NormswapError as e:  # e.g. the triton backend cannot run here (its reason), or a module failed verification
    print(f"no patched diff: {e}")
else:
    print(f"patched with triton: perplexity {diff.ppl_b:.3f} ({100 * diff.relative_delta:+.4f}%), "
          f"mean KL {diff.kl_mean:.2e}, top-1 agreement {100 * diff.top1_agreement:.2f}%")
