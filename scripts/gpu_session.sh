#!/usr/bin/env bash
# Every GPU check and benchmark the project has, in ONE call of under 8 minutes on a CUDA machine
# (a lent GPU is held for about 15 minutes, its start included: one run, one rerun).
#
#   OUT=/some/dir scripts/gpu_session.sh [--dry-run] [--budget SECONDS] [PHASE ...]
#
# Run from the repository root (CuPy, PyTorch and pytest installed; no network needed). Setup runs
# once; the phases follow in the order of what their figures are worth, each printing as it
# finishes and writing its own log under $OUT (default ./gpu_out). Every command runs under
# `timeout`, capped by its phase's share and by what is left of --budget (default 450 s); a phase
# the budget no longer covers is skipped and says so. --dry-run prints every command without
# running it (tests/project/test_gpu_session.py runs it in CI).
#
#   setup      GPU and versions; this checkout installed (editable, no index) or mapped by a
#              sitecustomize; the wheels under $GPU_ASSETS (default ./.gpu: starlette, uvicorn)
#              put on the path; then, in the background on the CPU, the s110 GGUF files (F32 with
#              $GPU_ASSETS/tokenizer.bin, Q8_0 and Q4_K_M by `minillama quantize`)
#   tests      the CuPy parity tests: every kernel against the reference, flash attention, the
#              CUDA-graph decoder and its CLI, mixed precision, quantized GGUF products, and the
#              whole-model, generation, engine and KV-cache tests on the cupy backend
#   quant      batch-1 decode and prompt tokens/s of the s110 F32, Q8_0 and Q4_K_M files on the
#              GPU (quant.cu's Q8_0/Q4_K kernels; python -m scripts.bench_gguf --backend cupy)
#   train      the s110 training step (B8 T1024): fp32 against PyTorch eager, tf32/bf16 against
#              eager TF32 / autocast bf16 (python -m scripts.bench_gpu --precisions)
#   decode     greedy decode B=1 and B=8 of s110, eager and CUDA graph, against PyTorch's
#              static-cache CUDA graph
#   serve      `minillama serve --backend cupy` under 1 and 8 streaming clients (the engine's
#              batched decode) on the Q8_0 and F32 files (python -m scripts.bench_serve)
#   cli        `minillama generate --backend cupy`: the Q4_K_M file, the shipped model and the
#              s110 F32 file with --cuda-graph on/off; `minillama train --precision fp32/bf16`
#              on Shakespeare side by side (their loss curves compared)
#   attention  attention fwd+bwd against PyTorch SDPA, T 256..8192, hd 64/128, MHA/GQA/MQA
#   retrain    (only when named; a call of its own, ~8 min) a larger Shakespeare model (D 256,
#              L 8, hd 64, 5.9M parameters) exported to $OUT, measured by scripts.eval_shakespeare;
#              copy it to minillama/weights/ only if it is <= 1.90 bits/byte
#
# With the device tool: copy llama2.c's tokenizer.bin and the starlette/uvicorn wheels into .gpu/
# (ignored by .git/info/exclude), carry .gpu, and run `OUT=$OUT scripts/gpu_session.sh` with a
# timeout of the budget plus a minute.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-$PWD/gpu_out}"
ASSETS="${GPU_ASSETS:-$PWD/.gpu}"
DRY=0
BUDGET=450
PHASES=()
ALL="setup tests quant train decode serve cli attention retrain"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --budget) BUDGET="${2:-}"; shift
                  case "$BUDGET" in ''|*[!0-9]*) echo "gpu_session: --budget needs seconds" >&2
                                                exit 2 ;; esac ;;
        setup|tests|quant|train|decode|serve|cli|attention|retrain) PHASES+=("$1") ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) echo "gpu_session: unknown phase '$1' ($ALL)" >&2
           exit 2 ;;
    esac
    shift
done
[ ${#PHASES[@]} -eq 0 ] && PHASES=(setup tests quant train decode serve cli attention)
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
WORK="${TMPDIR:-/tmp}/minillama_gpu_session"
GGUF="$WORK/gguf"
DEADLINE=$((SECONDS + BUDGET))

# run LOG CAP CMD...: print the command into LOG, then run it (unless --dry-run) for at most CAP
# seconds or what is left of the budget, its output into LOG too
run() {
    local log="$OUT/$1.log" cap="$2"
    shift 2
    echo "\$ $(printf '%q ' "$@")" | tee -a "$log"  # re-runnable as printed
    [ "$DRY" -eq 1 ] && return 0
    local left=$((DEADLINE - SECONDS - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
        echo "# skipped: the budget is spent" | tee -a "$log"
        return 0
    fi
    local t0=$SECONDS
    local limit=()
    command -v timeout >/dev/null && limit=(timeout -k 5 "$cap")
    "${limit[@]}" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local note=""
    [ "$rc" -eq 124 ] && note=" (cut at $cap s)"
    echo "# exit $rc after $((SECONDS - t0)) s$note" | tee -a "$log"
    return 0
}

# minillama.backends lives in backends/ (setuptools package-dir); without an installed checkout, a
# sitecustomize on PYTHONPATH maps it so (the same effect as the editable install's finder)
shim() {
    mkdir -p "$WORK/shim"
    cat > "$WORK/shim/sitecustomize.py" <<PYEOF
import importlib.util
import sys
_BASE = "$PWD/backends"
class _BackendsFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "minillama.backends":
            return None
        return importlib.util.spec_from_file_location(
            name, _BASE + "/__init__.py", submodule_search_locations=[_BASE])
sys.meta_path.insert(0, _BackendsFinder)
PYEOF
    export PYTHONPATH="$WORK/shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "# minillama.backends mapped by $WORK/shim/sitecustomize.py" | tee -a "$OUT/setup.log"
}

phase_setup() {
    mkdir -p "$WORK" "$GGUF"
    run setup 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
        --format=csv
    if compgen -G "$ASSETS/*.whl" >/dev/null || [ "$DRY" -eq 1 ]; then
        run setup 60 "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --target "$WORK/site" "$ASSETS"/*.whl
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    run setup 60 "$PY" -m pip install -qqq --no-deps --no-build-isolation --no-index -e .
    if [ "$DRY" -eq 0 ] && ! "$PY" -c "import minillama.backends" 2>/dev/null; then
        shim
    fi
    run setup 30 "$PY" -c "import minillama, minillama.backends as b, cupy, numpy, sys; \
print('minillama', minillama.__file__, '| cupy', cupy.__version__, '| numpy', numpy.__version__, \
'| python', sys.version.split()[0]); from minillama.backends import get_backend; \
print(get_backend('cupy').device); from minillama.backends.cupy import build as cb; \
print('nvrtc', cb.nvrtc_version())"
    run setup 10 git log --oneline -1
    # the GGUF files, on the CPU while the tests use the GPU (the quant phase waits for them)
    local files=("$PY" -m scripts.bench_gguf --make-files --types F32,Q8_0,Q4_K_M --workdir "$GGUF"
                 --tokenizer "$ASSETS/tokenizer.bin")
    echo "\$ $(printf '%q ' "${files[@]}")" | tee -a "$OUT/setup.log"
    echo "# (in the background; the quant, serve and cli phases wait for it)" \
        | tee -a "$OUT/setup.log"
    if [ "$DRY" -eq 0 ] && [ $((DEADLINE - SECONDS)) -gt 60 ]; then
        "${files[@]}" >"$WORK/files.log" 2>&1 &
        FILES_PID=$!
    fi
}

# wait_files LOG: wait for the background GGUF files (at most what the budget leaves)
wait_files() {
    [ "$DRY" -eq 1 ] && return 0
    while [ -n "${FILES_PID:-}" ] && kill -0 "$FILES_PID" 2>/dev/null \
            && [ $((DEADLINE - SECONDS)) -gt 30 ]; do
        sleep 1
    done
    cat "$WORK/files.log" >>"$OUT/$1.log" 2>/dev/null
}

phase_tests() {
    # -p no:cacheprovider: the tree may be read-only; MINILLAMA_GPU_EXAMPLES keeps hypothesis short
    MINILLAMA_GPU_EXAMPLES=8 run tests 130 "$PY" -m pytest -p no:cacheprovider -q -n 8 -rfE \
        --durations=8 -k cupy tests/backends/cupy/test_backend.py tests/backends/cupy/test_cuda_graph_cli.py \
        tests/backends/cupy/test_mixed_precision.py tests/model/test_model.py tests/infer/test_generate.py \
        tests/infer/test_engine.py tests/model/test_kvcache.py tests/backends/test_config_backend.py
}

phase_quant() {
    wait_files quant
    run quant 90 "$PY" -m scripts.bench_gguf --backend cupy --reps 2 --tg 128 --pp 512 \
        --gguf "$GGUF/s110-F32.gguf" "$GGUF/s110-Q8_0.gguf" "$GGUF/s110-Q4_K_M.gguf"
}

phase_train() {
    run train 75 "$PY" -m scripts.bench_gpu --shapes s110 --no-decode --steps 3 --warmup 2 \
        --precisions fp32,tf32,bf16
}

phase_decode() {
    run decode 50 "$PY" -m scripts.bench_gpu --shapes s110 --no-train --batches 1,8 \
        --decode-tokens 128
}

phase_serve() {
    wait_files serve
    for t in Q8_0 F32; do
        run serve 40 "$PY" -m scripts.bench_serve --backend cupy --checkpoint \
            "$GGUF/s110-$t.gguf" --clients 1,8 --tokens 64 --rounds 2 --max-context 256
    done
}

phase_cli() {
    wait_files cli
    run cli 30 "$PY" -m minillama generate -c "$GGUF/s110-Q4_K_M.gguf" --backend cupy \
        --temperature 0 -n 128 --prompt "Once upon a time"
    for mode in off on; do
        run cli 25 "$PY" -m minillama generate -c "$GGUF/s110-F32.gguf" --backend cupy \
            --temperature 0 -n 300 --prompt "Once upon a time" --cuda-graph "$mode"
    done
    run cli 20 "$PY" -m minillama generate --backend cupy --temperature 0 -n 250 \
        --prompt "ROMEO:" --cuda-graph on
    for prec in fp32 bf16; do
        run cli 35 "$PY" -m minillama train --backend cupy --precision "$prec" --steps 300 \
            --eval-interval 100 --plot false --no-progress --time-limit 0.4 \
            --out "$WORK/train_$prec"
    done
    run cli 15 "$PY" -c "import numpy as np; from minillama.io.checkpoint import load_checkpoint; \
h = {p: np.array(load_checkpoint('$WORK/train_' + p + '/ckpt.safetensors')[2]['train_state'] \
['history']['train']) for p in ('fp32', 'bf16')}; n = min(len(h['fp32']), len(h['bf16'])); \
f, b = h['fp32'][:n, 1], h['bf16'][:n, 1]; \
print('steps', int(h['fp32'][n - 1, 0]), '| bf16 max rel. dev. from fp32 %.4f | last-20 mean \
bf16 %.4f fp32 %.4f (%.2f%%)' % (np.max(np.abs(b - f) / f), b[-20:].mean(), f[-20:].mean(), \
100 * (b[-20:].mean() / f[-20:].mean() - 1)))"
}

phase_attention() {
    run attention 120 "$PY" -m scripts.bench_gpu --attention --reps 3 --no-simt
}

phase_retrain() {
    mkdir -p "$WORK"
    run retrain 560 "$PY" -m minillama train --backend cupy --dim 256 --n-layers 8 --n-heads 4 \
        --n-kv-heads 2 --context 256 --batch-size 16 --steps 6000 --lr 1e-3 --min-lr 1e-4 \
        --warmup 200 --weight-decay 0.1 --grad-clip 1.0 --eval-interval 500 --eval-iters 16 \
        --seed 1337 --plot false --no-progress --time-limit 7 --out "$WORK/large" \
        --export "$OUT/shakespeare_large.safetensors"
    run retrain 60 "$PY" -m scripts.eval_shakespeare --backend cupy \
        --checkpoint "$OUT/shakespeare_large.safetensors"
}

for p in "${PHASES[@]}"; do
    t0=$SECONDS
    echo "## phase $p ($(date -u +%H:%M:%S) UTC, $((DEADLINE - SECONDS)) s of the budget left)" \
        | tee -a "$OUT/$p.log"
    "phase_$p"
    echo "## phase $p done in $((SECONDS - t0)) s" | tee -a "$OUT/$p.log"
done
