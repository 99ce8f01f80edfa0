"""Scan a model's norms from Python: which norms, what arithmetic, who reads them.

    python examples/scan_model.py                 # the embedded SmolLM2-135M
    python examples/scan_model.py path/to/model   # a local directory, a .gguf, or a cached hub id

No weights are read: the model is built on the meta device from its config.
"""

import sys
from collections import Counter

from normswap.scan import scan

doc = scan(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
print(f"{doc['model']}: {doc['model_class']}, {doc['summary']['norms']} norms")
for (kind, casting, offset, eps), n in Counter(
    (r["kind"], r["casting"], r["offset"], r["eps"]) for r in doc["norms"]
).items():
    print(f"  {n:4d} x {kind} norm, casting={casting}, offset={offset:g}, eps={eps:.3g}")
final = doc["norms"][-1]
print(f"final norm {final['path']} is read by {', '.join(final['readers'] or ['?'])}")
for u in doc["unknown"]:
    print(f"  not recognised: {u['path']} ({u['class']}): {u['reason']}")
