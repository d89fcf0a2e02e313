"""Every fact about the stages, in one place: the CLI, the report, the charts, the notebooks,
the Makefile's help and the benchmarks all read this table, and nothing else says it again.

Adding a stage is one entry here plus its module (a Backend subclass of the stage it builds on).

Numbers follow the article's chapters (1-6, cuda being its sixth), then ours (7 on); `STAGES`
is in that order, and a stage's chapter is notebooks/<its number>_<its name> (chapters that are no
stage take numbers no stage has: 00, and 14 on). `builds_on` is the stage a stage's backend
inherits from: the stage it is compared with ("vs previous" in the report). A variant is the same lesson with one part
swapped (e.g. int8 with its plain loops instead of the named instructions), loadable by name
for side-by-side measurements but not a stage of its own.

`kernels` says which files under stages/ each stage brings: a stage's files import only its own
and those of the stages it builds on (`python -m app stages` counts the lines of each; a test holds
the rule).

Token counts are what each stage generates by default: the stages without a KV cache
recompute the whole text for every token, so they generate fewer, to finish in about a
minute on 2 cores.

Runs with no dependency at all (`python3 stages/registry.py` prints the table): the Makefile's
help calls it before anything is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

# The report's prompt length, the same for every stage so that TTFT compares like with like.
REPORT_PROMPT_TOKENS = 32
# Above this many parameters `make report` leaves out the stages with a `max_params` below it
# unless they are named (on TinyLlama's 1.1B, naive alone would take ~20 minutes).
LARGE_MODEL_PARAMS = 500e6


@dataclass(frozen=True)
class Tokens:
    run: int = 64          # `python -m app run` without -n
    report: int = 64       # `make report` and `python -m app bench`
    profile: int = 32      # the per-op profiled run of the report


@dataclass(frozen=True)
class Stage:
    name: str
    number: int
    module: str                      # stages.<module>
    backend: str                     # the Backend subclass in it
    builds_on: str | None
    lesson: str                      # one line, as the README's stage table shows it
    kv_cache: bool                   # keeps K and V between steps (else recomputes the whole text)
    chapter: str                     # the notebook that teaches it (notebooks/<chapter>.ipynb)
    gpu: bool = False
    parallel: bool = False           # runs on --threads cores (the others on one)
    tokens: Tokens = Tokens()
    max_params: float | None = None  # left out of `make report` above this size unless named
    variant_of: str | None = None    # a registered variant: not in STAGES, loadable by name
    ranks: bool = False              # runs as N processes (mpiexec -n N): never picked as `fastest`
    kernels: tuple = ()              # the files under stages/ besides its module that the stage brings
                                     # (its lesson's code); a stage imports its own, and earlier stages'

    @property
    def label(self) -> str:
        return f"Stage {self.number}, {self.name}" if self.variant_of is None else \
            f"{self.name} (a variant of {self.variant_of})"

    @property
    def path(self) -> str:
        return self.module.replace(".", "/") + ".py"


_RECOMPUTING = Tokens(run=8, report=4, profile=2)

REGISTRY = {s.name: s for s in (
    Stage("naive", 1, "stages.naive", "NaiveBackend", None,
          "the textbook: float32 weights, triple-loop matmul, no KV cache",
          kv_cache=False, chapter="01_naive", tokens=_RECOMPUTING, max_params=LARGE_MODEL_PARAMS),
    Stage("tiling", 2, "stages.tiling", "TilingBackend", "naive",
          "block the loops so the caches are reused",
          kv_cache=False, chapter="02_tiling", tokens=_RECOMPUTING, max_params=LARGE_MODEL_PARAMS),
    Stage("simd", 3, "stages.simd", "SimdBackend", "tiling",
          "pack the weights so the inner loop is contiguous; let LLVM vectorize it",
          kv_cache=False, chapter="03_simd", tokens=Tokens(run=32, report=16, profile=8),
          kernels=("kernels/toolkit.py",)),
    Stage("kv_cache", 4, "stages.kv_cache", "KVCacheBackend", "simd",
          "keep K and V: each new token costs one token's work",
          kv_cache=True, chapter="04_kv_cache"),
    Stage("quantized", 5, "stages.quantized", "QuantizedBackend", "kv_cache",
          "compute straight from the 4-bit blocks: far fewer bytes per weight",
          kv_cache=True, chapter="05_quantized", kernels=("kernels/dequant_dot.py",)),
    Stage("cuda", 6, "stages.cuda", "CudaBackend", "quantized",
          "the whole forward pass on the GPU, nothing allocated per token",
          kv_cache=True, chapter="06_cuda", gpu=True, kernels=("kernels/cuda_runtime.py", "kernels/cuda.cu")),
    Stage("threads", 7, "stages.threads", "ThreadsBackend", "quantized",
          "all cores: what a second core buys a memory-bound loop",
          kv_cache=True, chapter="07_threads", parallel=True, kernels=("kernels/threaded.py",)),
    Stage("int8", 8, "stages.int8", "Int8Backend", "threads",
          "round activations to int8, as llama.cpp does, for integer dot products",
          kv_cache=True, chapter="08_int8", parallel=True,
          kernels=("kernels/vector_ir.py", "kernels/q8.py", "kernels/int_dot.py")),
    Stage("int8-loops", 8, "stages.int8", "Int8LoopsBackend", "threads",
          "int8 with plain integer loops for LLVM's auto-vectorizer instead of the named instructions",
          kv_cache=True, chapter="08_int8", parallel=True, variant_of="int8"),
    Stage("fused", 9, "stages.fused", "FusedBackend", "int8",
          "one compiled call per token: no Python or fork/join between the ops",
          kv_cache=True, chapter="09_fused", parallel=True,
          kernels=("kernels/sync.py", "kernels/layer_ops.py", "kernels/int_tiles.py", "kernels/layer_stack.py")),
    Stage("repack", 10, "stages.repack", "RepackBackend", "fused",
          "lay the weights out as the vector unit reads them: 8 rows interleaved, one lane each",
          kv_cache=True, chapter="10_repack", parallel=True,
          kernels=("kernels/repacked.py", "kernels/repack_steps.py")),
    Stage("tp", 11, "stages.tp", "TensorParallelBackend", "repack",
          "split every layer across N processes (MPI ranks): two all-reduces per layer",
          kv_cache=True, chapter="11_tp", parallel=True, ranks=True,
          kernels=("parallel/ranks.py", "parallel/shards.py", "parallel/split.py", "parallel/steps.py")),
    Stage("prefill", 12, "stages.prefill", "PrefillBackend", "repack",
          "the prompt is compute-bound: more multiply-adds per loaded byte (attention in tiles, two rows "
          "per register)",
          kv_cache=True, chapter="12_prefill", parallel=True,
          kernels=("kernels/pair_gemm.py", "kernels/tile_gemm.py", "kernels/tiled_attention.py",
                   "kernels/prefill_steps.py")),
    Stage("amx", 13, "stages.amx", "AmxBackend", "prefill",
          "the prompt on the CPU's matrix unit: 16 x 16 x 64 int8 multiply-adds an instruction (AMX tiles)",
          kv_cache=True, chapter="13_amx", parallel=True, kernels=("kernels/amx_tiles.py", "kernels/amx_steps.py")),
)}

STAGES = [s.name for s in sorted(REGISTRY.values(), key=lambda s: s.number) if s.variant_of is None]
VARIANTS = [s.name for s in REGISTRY.values() if s.variant_of is not None]


def stage_table() -> str:
    """The stages as `make help` lists them."""
    return "\n".join(f"  {s.number}  {s.name:<10} {s.lesson}" for s in map(REGISTRY.get, STAGES))


if __name__ == "__main__":
    print(stage_table())
