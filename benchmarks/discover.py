"""How long stream discovery takes on 70B-class LayerNorm configs (meta device, no weights).

For each config: the time to build the model on the meta device, and the time of one discovery
(the traced forward plus the analysis, normswap.plan.plan_conversion with arch_data=False), both
measured after imports, best of --repeat runs, as wall-clock and as this process's CPU time (on a
shared machine the wall-clock mostly measures the other processes). The target is discovery < 3 s.

    python benchmarks/discover.py [--repeat 3]

Writes a table to stdout and JSON to benchmarks/results/discover-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Published configs of the largest LayerNorm decoders, sizes only (what discovery depends on).
CONFIGS = {
    "falcon-180b": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=65024, hidden_size=14848, num_hidden_layers=80, num_attention_heads=232, num_kv_heads=8,
        new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False)),
    "opt-66b": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=50272, hidden_size=9216, num_hidden_layers=64, num_attention_heads=72, ffn_dim=36864,
        max_position_embeddings=2048, word_embed_proj_dim=9216)),
    "bloom-176b": ("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=250880, hidden_size=14336, n_layer=70, n_head=112)),
    "gpt-neox-20b": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
        intermediate_size=24576, max_position_embeddings=2048)),
}


def measure(name: str, repeat: int) -> dict:
    import torch
    import transformers

    from normswap.plan import plan_conversion

    cfg_name, model_name, kwargs = CONFIGS[name]
    config = getattr(transformers, cfg_name)(**kwargs)
    builds, discoveries, cpu = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = getattr(transformers, model_name)(config)
        t1, c1 = time.perf_counter(), time.process_time()
        plan = plan_conversion(model, config, arch_data=False)
        t2, c2 = time.perf_counter(), time.process_time()
        builds.append(t1 - t0)
        discoveries.append(t2 - t1)
        cpu.append(c2 - c1)
    params = sum(p.numel() for p in model.parameters())
    return {"config": name, "params_billion": round(params / 1e9, 1), "norms": len(plan.norms),
            "converted": len(plan.converted), "build_s": min(builds), "discover_s": min(discoveries),
            "discover_cpu_s": min(cpu)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per config; the best is reported (default 3)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import normswap  # noqa: F401  (sets the environment before transformers)
    from normswap.fileio import write_text_atomic

    rows = [measure(name, args.repeat) for name in CONFIGS]
    print(f"{'config':<14} {'params':>8} {'norms':>6} {'converted':>9} {'build s':>8} {'discover s':>10} "
          f"{'discover cpu s':>14}")
    for r in rows:
        print(f"{r['config']:<14} {r['params_billion']:>7}B {r['norms']:>6} {r['converted']:>9} "
              f"{r['build_s']:>8.2f} {r['discover_s']:>10.2f} {r['discover_cpu_s']:>14.2f}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    path = ROOT / "benchmarks" / "results" / f"discover-{socket.gethostname()}-{dt.date.today().isoformat()}.json"
    meta = {"host": socket.gethostname(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "python": platform.python_version(), "repeat": args.repeat}
    # atomically, as every results file (a plain write_text truncated an earlier run's file of the
    # same day before writing: a full disk or a kill mid-write left it half-written); makes the folders
    write_text_atomic(path, json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
