#!/usr/bin/env bash
# The cuda stage on a machine with an NVIDIA GPU, nvcc and python3 but no network:
#   1. install PyCUDA from .whl/ (scripts/prepare_gpu_wheels.sh fills it where PyPI is reachable)
#   2. run the GPU tests (pytest -m gpu tests/test_cuda.py)
#   3. benchmark and profile the stage on synthetic TinyLlama (made here from
#      models/vocab/ggml-vocab-llama-spm.gguf) and on the default model when it is here
#   4. if time is left, run the kernel tests under compute-sanitizer: memcheck (out-of-bounds and
#      misaligned accesses), racecheck (shared-memory hazards), initcheck (reads of device memory
#      nothing wrote) and synccheck (barriers some threads of a block or warp never reach); the CPU
#      emulator checks the same on every machine (tests/test_emulator.py), this on the real GPU
# and write JSON under profiles/results/<machine>/ (bench records, cuda_profile.json, and
# gpu_check.json, the summary); with $OUT set, also summary + everything as a tarball into $OUT.
#
#   bash scripts/gpu_check.sh           from the repository root; about 5-8 minutes
#
# The default model (94 MB) is used from models/ or from the parts of `prepare_gpu_wheels.sh
# --with-model` in .gpu_model/; without it, the tests that need it skip and the tests' tiny
# synthetic model (every ggml type, grouped heads, tied embeddings) checks logits and greedy
# tokens instead.
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-450}           # seconds; optional steps are skipped past it
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/llm-gpu-site}
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/llm-numba-cache}
export PYTHONUNBUFFERED=1
DEFAULT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SYNTH_MODEL=models/tinyllama-1.1b-synthetic.Q4_K_M.gguf

elapsed() { echo $(( $(date +%s) - START )); }
step() { echo; echo "=== $* [$(elapsed) s]"; }
STATUS=()                                  # "name|status|seconds|detail"
note() { STATUS+=("$1|$2|$3|${4:-}"); echo "--- $1: $2 (${3} s) ${4:-}"; }
run_step() {                               # name, timeout, command...: logs to $LOGS/name.log
    local name=$1 limit=$2 t0 rc; shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" > >(tee "$LOGS/$name.log") 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then note "$name" ok $(( $(date +%s) - t0 ));
    elif [ $rc -eq 124 ]; then note "$name" "timed out" $(( $(date +%s) - t0 )) "after ${limit} s";
    else note "$name" "failed (rc $rc)" $(( $(date +%s) - t0 )); fi
    return $rc
}

step "machine"
MACHINE=$($PY -c "from app.measure.machine import machine_id; print(machine_id())" 2>/dev/null || echo unknown)
RESULTS=profiles/results/$MACHINE
LOGS=$RESULTS/tmp/gpu_check                # profiles/results/*/tmp/ is git-ignored
mkdir -p "$LOGS"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || echo "nvidia-smi failed"
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "no nvcc on PATH"
  $PY --version; echo "machine id: $MACHINE"; } 2>&1 | tee "$LOGS/machine.log"

step "PyCUDA"
if $PY -c "import pycuda.driver" 2>/dev/null; then
    note pycuda ok 0 "already installed"
else
    run_step install_pycuda 300 bash scripts/install_pycuda.sh --offline "$WHEELS" --target "$SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
READY=0
if $PY -c "import stages.kernels.cuda_runtime as c, sys; r = c.probe(); print(r or 'cuda stage: ready'); sys.exit(1 if r else 0)" \
        2>&1 | tee "$LOGS/probe.log"; then
    READY=1
fi

step "models"
if [ ! -f "$DEFAULT_MODEL" ] && ls .gpu_model/*.part-* >/dev/null 2>&1; then
    mkdir -p models
    cat .gpu_model/*.part-* > "$DEFAULT_MODEL.part"
    if (cd models && sha256sum -c --quiet <(sed "s|  .*|  $(basename "$DEFAULT_MODEL").part|" ../.gpu_model/SHA256SUMS)); then
        mv "$DEFAULT_MODEL.part" "$DEFAULT_MODEL"; echo "default model reassembled from .gpu_model/"
    else
        rm -f "$DEFAULT_MODEL.part"; echo "the parts in .gpu_model/ are incomplete or corrupt: no default model"
    fi
fi
[ -f "$DEFAULT_MODEL" ] && echo "default model: $DEFAULT_MODEL" || echo "default model: absent (its tests skip)"
if [ -f models/vocab/ggml-vocab-llama-spm.gguf ] && [ ! -f "$SYNTH_MODEL" ]; then
    touch models/vocab/.complete            # the vocab is here: nothing to download
    run_step synth_model 180 $PY -m app model tinyllama-synthetic
fi

if [ $READY = 1 ]; then
    step "GPU tests"
    run_step gpu_tests 300 $PY -m pytest -q -s -m gpu tests/test_cuda.py -rs -p no:cacheprovider \
        --junitxml="$LOGS/gpu_tests.xml"

    step "benchmark and profile"
    for model in "$SYNTH_MODEL" "$DEFAULT_MODEL"; do
        [ -f "$model" ] || continue
        if [ "$(elapsed)" -gt "$BUDGET" ]; then note "bench $(basename "$model")" skipped 0 "out of time"; continue; fi
        tag=$(basename "$model" .gguf)
        run_step "bench_$tag" 180 $PY -m app bench --stage cuda -m "$model"
        run_step "profile_$tag" 180 $PY -m app bench cuda-profile -m "$model"
    done

    step "the article's two mistakes, reproduced (stages/cuda.py switches)"
    if [ -f "$SYNTH_MODEL" ] && [ "$(elapsed)" -le "$BUDGET" ]; then
        run_step mistake_alloc_per_op 180 env LLM_CUDA_ALLOC_PER_OP=1 $PY -m app bench --stage cuda \
            -m "$SYNTH_MODEL" --out "$RESULTS/article-mistakes/alloc-per-op"
        run_step mistake_host_embedding 180 env LLM_CUDA_HOST_EMBEDDING=1 $PY -m app bench --stage cuda \
            -m "$SYNTH_MODEL" --out "$RESULTS/article-mistakes/host-embedding"
    else
        note article_mistakes skipped 0 "no synthetic model or out of time"
    fi

    step "compute-sanitizer"
    if ! command -v compute-sanitizer >/dev/null; then
        note sanitizer skipped 0 "compute-sanitizer not on PATH"
    elif [ "$(elapsed)" -gt "$BUDGET" ]; then
        note sanitizer skipped 0 "out of time"
    else
        KERNEL_TESTS="gpu and (matmul_every_type or embed_every_type or rms_norm or rope or attention or argmax or kv_store or tiny_model_logits)"
        run_step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
            $PY -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider -k "$KERNEL_TESTS"
        BARRIER_TESTS="gpu and (rms_norm or attention or argmax or matmul_every_type)"
        for tool in racecheck synccheck; do
            if [ "$(elapsed)" -gt "$BUDGET" ]; then note "$tool" skipped 0 "out of time"; continue; fi
            run_step "$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
                $PY -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider -k "$BARRIER_TESTS"
        done
        if [ "$(elapsed)" -gt "$BUDGET" ]; then
            note initcheck skipped 0 "out of time"
        else
            run_step initcheck 150 compute-sanitizer --tool initcheck --error-exitcode 9 \
                $PY -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider -k "$KERNEL_TESTS"
        fi
    fi
fi

step "summary"
printf '%s\n' "${STATUS[@]}" > "$LOGS/steps.txt"
$PY - "$RESULTS" "$LOGS" "$(elapsed)" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

results, logs, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
steps = []
for line in (logs / "steps.txt").read_text().splitlines():
    if line:
        name, status, secs, detail = (line.split("|") + [""])[:4]
        steps.append({"step": name, "status": status, "seconds": int(secs or 0), "detail": detail})
summary = {"kind": "gpu_check", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": seconds, "steps": steps,
           "probe": (logs / "probe.log").read_text().strip() if (logs / "probe.log").exists() else None,
           "machine_log": (logs / "machine.log").read_text() if (logs / "machine.log").exists() else None}
log = logs / "gpu_tests.log"
if log.exists():
    summary["measured"] = [line.strip() for line in log.read_text().splitlines() if "max |logit" in line]
xml = logs / "gpu_tests.xml"
if xml.exists():
    cases = []
    for tc in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                detail = (el.get("message") or "")[:300]
                break
        else:
            detail = ""
        cases.append({"test": tc.get("name"), "outcome": outcome, "seconds": float(tc.get("time") or 0), "detail": detail})
    summary["tests"] = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "error", "skipped")}
    summary["test_cases"] = cases
benches = {}
for f in sorted(results.glob("*/cuda.json")):
    r = json.loads(f.read_text())
    benches[r["model"]] = {k: r.get(k) for k in ("ttft_ms", "decode_ms", "decode_ms_mean", "tokens_per_s",
                                                 "n_prompt", "n_generated", "load_s", "jit_s", "weights_mb")}
for f in sorted(results.glob("*/cuda_profile.json")):
    r = json.loads(f.read_text())
    b = benches.setdefault(r["model"], {})
    b["copies_per_token"] = r["decode"]["copies_per_token"]
    b["device_allocs_while_generating"] = r["device_allocs_while_generating"]
    b["top_decode_kernels"] = [(k["kernel"], round(k["share"] * 100, 1)) for k in r["decode"]["kernels"][:5]]
    b["gpu"] = r["device"]["name"]
summary["models"] = benches
out = results / "gpu_check.json"
out.write_text(json.dumps(summary, indent=1))

print(f"gpu_check: {seconds} s; {summary['probe']}")
for s in steps:
    print(f"  {s['step']:<40} {s['status']:<16} {s['seconds']:>4} s  {s['detail']}")
for line in summary.get("measured", []):
    print(f"  {line}")
if "tests" in summary:
    t = summary["tests"]
    print(f"  GPU tests: {t['passed']} passed, {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped")
    for c in summary["test_cases"]:
        if c["outcome"] != "passed":
            print(f"    {c['outcome']:<8} {c['test']}: {c['detail'][:160]}")
for model, b in benches.items():
    if "decode_ms" in b:
        print(f"  {model}: TTFT {b['ttft_ms']:.1f} ms, decode {b['decode_ms']:.2f} ms/token "
              f"({b['tokens_per_s']:.0f} tokens/s), {b['n_prompt']} prompt tokens")
    if "copies_per_token" in b:
        c = b["copies_per_token"]
        print(f"    per token: {c['h2d_count']:.0f} H2D ({c['h2d_bytes']:.0f} B), {c['d2h_count']:.0f} D2H "
              f"({c['d2h_bytes']:.0f} B); device allocations while generating: {b['device_allocs_while_generating']}; "
              f"top kernels {b['top_decode_kernels']}")
print(f"wrote {out}")
EOF

if [ -n "${OUT:-}" ]; then
    cp "$RESULTS/gpu_check.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/gpu_check.tar.gz" -C "$RESULTS" . 2>/dev/null && echo "copied the results to \$OUT"
fi
echo "done in $(elapsed) s"
