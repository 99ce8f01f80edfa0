"""Streaming LayerNorm → RMSNorm conversion of a ~2 GB synthetic sharded checkpoint.

Builds a GPT-2-shaped checkpoint (random weights written straight to safetensors shards, one
tensor at a time: no model is instantiated), converts it shard by shard in a fresh subprocess
(so its peak RSS is the conversion's own), and reports throughput (MB of checkpoint per second)
and peak memory: ru_maxrss of the child, the RSS it started with after imports, and the largest
tensor group a job holds. Optionally the in-memory path for contrast (--in-memory).

    python benchmarks/convert.py [--layers 15 --hidden 1536 --shard-mb 500] [--in-memory]
    python benchmarks/convert.py --errors     # per-architecture logit errors (tiny models)

Writes a table to stdout and JSON to benchmarks/results/convert-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_checkpoint(directory: Path, layers: int, hidden: int, vocab: int, positions: int, shard_mb: int) -> int:
    """Write a GPT-2-shaped fp32 checkpoint in shards of about shard_mb; return its size in bytes."""
    import torch

    from normswap.streaming import INDEX_NAME, SafetensorsWriter

    d, f = hidden, 4 * hidden
    shapes: list[tuple[str, list[int]]] = [("transformer.wte.weight", [vocab, d]), ("transformer.wpe.weight", [positions, d])]
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes += [
            (p + "ln_1.weight", [d]), (p + "ln_1.bias", [d]),
            (p + "attn.c_attn.weight", [d, 3 * d]), (p + "attn.c_attn.bias", [3 * d]),
            (p + "attn.c_proj.weight", [d, d]), (p + "attn.c_proj.bias", [d]),
            (p + "ln_2.weight", [d]), (p + "ln_2.bias", [d]),
            (p + "mlp.c_fc.weight", [d, f]), (p + "mlp.c_fc.bias", [f]),
            (p + "mlp.c_proj.weight", [f, d]), (p + "mlp.c_proj.bias", [d]),
        ]
    shapes += [("transformer.ln_f.weight", [d]), ("transformer.ln_f.bias", [d])]
    # Greedy shards in name order, like save_pretrained's.
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = 4
        for s in shape:
            n *= s
        if shards[-1] and size + n > shard_mb * 2**20:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        w = SafetensorsWriter(directory / fname, [(n, torch.float32, s) for n, s in shard], {"format": "pt"})
        for name, shape in shard:
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                t = 1.0 + 0.3 * torch.randn(shape, generator=g)
            else:
                t = 0.02 * torch.randn(shape, generator=g)
            w.write(name, t)
            weight_map[name] = fname
            total += t.numel() * 4
            del t
        w.close()
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab, "n_embd": hidden,
        "n_layer": layers, "n_head": max(1, hidden // 64), "n_positions": positions, "n_inner": None,
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 0,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return total


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(src: str, out: str, streaming: bool) -> None:
    """Run in a fresh process: convert and print one JSON line of measurements."""
    import normswap  # noqa: F401  (sets the environment before transformers)
    from normswap import loading
    from normswap.convert_dir import convert_directory

    source = loading.resolve(src)
    loading.build_meta_model(source)  # warm the import of the model class
    base = _rss_kib()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib())
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    manifest = convert_directory(source, Path(out), streaming=streaming)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    stop.set()
    th.join()
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "rss_before_kib": base, "rss_peak_sampled_kib": peak[0],
                      "ru_maxrss_kib": ru, "converted_norms": manifest["summary"]["converted"]}))


def largest_group_bytes(layers: int, hidden: int, vocab: int) -> int:
    """Bytes a streaming job holds at once: its fp32 input (mapped), its fp32 output and one slice
    of float64 work (normswap.jobs.CHUNK_ELEMENTS elements, about three live copies). The
    biggest job here is centering wte (or copying it into the untied lm_head)."""
    from normswap.jobs import CHUNK_ELEMENTS

    d = hidden
    biggest = max(vocab * d, d * 4 * d + 6 * d)
    return biggest * (4 + 4) + 3 * 8 * CHUNK_ELEMENTS


def logit_errors() -> list[dict]:
    """Per architecture, max |Δlogit| / max |logit| of the converted tiny random model against the
    original: float64 and float32, run as stock LayerNorms and as RMSNorms through normswap patch."""
    import torch

    from normswap.convert import convert_model
    from normswap.manifest import rms_forms
    from normswap.swap import patch, revert
    from tests.tiny_models import VOCAB, tiny_model

    ids = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    rows = []
    for arch in ["gpt2", "opt", "gpt_neox", "phi", "falcon", "falcon_new", "bloom"]:
        row = {"arch": arch}
        for dtype, tag in ((torch.float64, "fp64"), (torch.float32, "fp32")):
            model = tiny_model(arch, dtype=dtype)
            with torch.no_grad():
                ref = model(input_ids=ids).logits
                manifest = convert_model(model)
                got = model(input_ids=ids).logits
                forms = rms_forms(manifest)  # weightless where γ was folded, β only where kept
                patch(model, "reference", rms_forms=forms, filter_fn=lambda _m, p, f=forms: p in f, verify=False)
                got_ref = model(input_ids=ids).logits
                revert(model)
                patch(model, "reference" if dtype == torch.float64 else "torch",
                      rms_forms=forms, verify=False)
                got_rms = model(input_ids=ids).logits
            scale = float(ref.abs().max())
            row[f"{tag}_layernorm"] = float((got - ref).abs().max()) / scale
            row[f"{tag}_rms_reference"] = float((got_ref - ref).abs().max()) / scale
            row[f"{tag}_rms_patch"] = float((got_rms - ref).abs().max()) / scale
        rows.append(row)
    return rows


def write_results(stem: str, doc: dict) -> Path:
    """benchmarks/results/<stem>-<host>-<date>.json, through the atomic write every results file
    takes (normswap.fileio): a plain write_text truncated an earlier run's file of the same day
    first, so a full disk or a kill mid-write left it half-written."""
    from normswap.fileio import write_text_atomic

    path = ROOT / "benchmarks" / "results" / f"{stem}-{socket.gethostname()}-{dt.date.today().isoformat()}.json"
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")  # makes the folders
    print(f"wrote {path}", file=sys.stderr)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=15, help="decoder layers of the synthetic GPT-2 (default 15)")
    ap.add_argument("--hidden", type=int, default=1536, help="its width (default 1536)")
    ap.add_argument("--vocab", type=int, default=50257, help="its vocabulary (default 50257, GPT-2's)")
    ap.add_argument("--positions", type=int, default=1024, help="its position table (default 1024)")
    ap.add_argument("--shard-mb", type=int, default=500, help="largest safetensors shard in MB (default 500)")
    ap.add_argument("--in-memory", action="store_true", help="also time the in-memory path")
    ap.add_argument("--workdir", default=None, help="where to build (default: a temp dir, removed after)")
    ap.add_argument("--errors", action="store_true",
                    help="only print the per-architecture logit errors of tiny random models")
    ap.add_argument("--child", nargs=3, metavar=("SRC", "OUT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] == "streaming")
        return
    if args.errors:
        rows = logit_errors()
        cols = ["fp64_layernorm", "fp64_rms_reference", "fp64_rms_patch",
                "fp32_layernorm", "fp32_rms_reference", "fp32_rms_patch"]
        print(f"{'arch':<11} " + " ".join(f"{c:>19}" for c in cols))
        for r in rows:
            print(f"{r['arch']:<11} " + " ".join(f"{r[c]:>19.2e}" for c in cols))
        print("layernorm: stock classes; rms_reference: the zero-mean LayerNorms as RMS norms with the reference "
              "impl, the other norms stock; rms_patch: every norm patched, rms_forms=normswap.manifest.rms_forms(...) "
              "(weightless where γ was folded; reference impl for fp64, torch for fp32)")
        write_results("convert-errors", {"what": "max |Δlogit| / max |logit|, tiny random models, probe 4x32",
                                         "rows": rows})
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="normswap-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    src.mkdir(exist_ok=True)
    try:
        t0 = time.perf_counter()
        total = build_checkpoint(src, args.layers, args.hidden, args.vocab, args.positions, args.shard_mb)
        build_s = time.perf_counter() - t0
        shards = len(list(src.glob("*.safetensors")))
        print(f"built {total / 1e9:.2f} GB in {shards} shards in {build_s:.1f} s", file=sys.stderr)
        rows = []
        for mode in ["streaming"] + (["in-memory"] if args.in_memory else []):
            out = work / f"out-{mode}"
            if out.exists():
                shutil.rmtree(out)
            out.mkdir()
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            r = subprocess.run([sys.executable, __file__, "--child", str(src), str(out), mode],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:
                sys.exit(f"conversion failed:\n{r.stderr[-3000:]}")
            m = json.loads(r.stdout.strip().splitlines()[-1])
            m.update(mode=mode, mb_per_s=total / 1e6 / m["wall_s"],
                     peak_over_start_mib=(m["rss_peak_sampled_kib"] - m["rss_before_kib"]) / 1024)
            rows.append(m)
            shutil.rmtree(out)
        result = {
            "benchmark": "convert --to rms (GPT-2 shape, fp32, sharded safetensors)",
            "host": socket.gethostname(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "shape": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
                      "positions": args.positions},
            "checkpoint_bytes": total, "shards": shards, "shard_mb": args.shard_mb,
            "largest_group_bytes_est": largest_group_bytes(args.layers, args.hidden, args.vocab),
            "note": "input freshly written, so largely in the page cache; a cold read adds disk time",
            "runs": rows,
        }
        print(f"{'mode':<10} {'GB':>6} {'wall s':>8} {'cpu s':>7} {'MB/s':>8} {'RSS start MiB':>14} "
              f"{'peak RSS MiB':>13} {'peak-start MiB':>15}")
        for m in rows:
            print(f"{m['mode']:<10} {total / 1e9:>6.2f} {m['wall_s']:>8.1f} {m['cpu_s']:>7.1f} {m['mb_per_s']:>8.0f} "
                  f"{m['rss_before_kib'] / 1024:>14.0f} {m['ru_maxrss_kib'] / 1024:>13.0f} "
                  f"{m['peak_over_start_mib']:>15.0f}")
        print(f"largest job (fp32 input + fp32 output + one float64 slice): "
              f"{result['largest_group_bytes_est'] / 2**20:.0f} MiB; checkpoint {total / 2**20:.0f} MiB")
        write_results("convert", result)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
