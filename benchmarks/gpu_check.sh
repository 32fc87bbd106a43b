#!/usr/bin/env bash
# remat on a CUDA machine in one command, each step under its own time limit so that a step that fails or
# overruns leaves the others their time:
#
#   benchmarks/gpu_check.sh OUT_DIR smoke           # GPU tests, tiny peers and tiny bench side by side (a minute)
#   benchmarks/gpu_check.sh OUT_DIR tests peers     # the GPU tests, then peers on GPT-2 small's shape under bf16
#   benchmarks/gpu_check.sh OUT_DIR bench           # remat bench on a GPT-2 medium at 50%, energy from NVML
#   benchmarks/gpu_check.sh OUT_DIR tests llama     # the GPU tests, then remat against hand-written and torch
#                                                   # checkpointing on a 1.2B Llama, bf16, sequence 2048
#   benchmarks/gpu_check.sh OUT_DIR shapes          # costs profiled at 4 x 512 against measured peaks and steps
#                                                   # at 128-2048 tokens and batches 2 and 8 (GPT-2, Llama,
#                                                   # BERT, T5 of width 768)
#
# Every step writes its log and results under OUT_DIR/files; OUT_DIR/results.tar.gz packs them at the end.
# PYTHON (default python3) is the interpreter that has torch with CUDA; remat is imported from src/.
# PEERS_COMPILE_SECONDS (150) bounds the peers unit's compiled part: no compiled contender is built after it.
# PEERS_MODELS (gpt2), PEERS_DTYPES (bf16), PEERS_LIMIT (360 s), PEERS_EXTRA (more options, like --no-compiled)
# and BENCH_LIMIT (150 s) change the peers and bench steps; LLAMA_LIMIT (330 s) and LLAMA_EXTRA (more options of
# benchmarks.gpu_llama; by default --compile-budget 0.5, compiled last so that the eager table is written first)
# the llama step; SHAPES_LIMIT (240 s) the shapes step. The peers step measures ckptplan's plans where
# ckptplan imports (from PYTHONPATH or /tmp/ckptplan: `pip install --no-deps --target DIR ckptplan` on a machine
# with a registry).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR smoke|tests|peers|bench...}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out/files"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench=("$py" -m remat.bench)  # remat bench, without installing the package
log="$out/steps.log"

step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output in files/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/files/$name.log" 2>&1
    local rc=$?
    echo "$(date -u +%H:%M:%S) $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$log"
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
transformers.__version__, torch.cuda.get_device_name())'
    nproc
} >"$out/machine.txt" 2>&1

for mode in "$@"; do
    case $mode in
    smoke)
        step gpu_tests 200 "$py" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -rA &
        step peers_tiny 200 "$py" -m benchmarks.peers --device cuda --size tiny --models gpt2 --dtypes bf16 \
            --budgets 0.5 --rounds 2 --duel-rounds 2 --duel-max-rounds 2 --choice-rounds 1 --retries 0 --unit-timeout 180 \
            --out "$out/files/peers_tiny.jsonl" --markdown "$out/files/peers_tiny.md" &
        step bench_tiny 200 "${bench[@]}" --device cuda --preset tiny --steps 6 --warmup 2 --seeds 1 \
            --no-progress --out "$out/files/bench_tiny" &
        wait
        ;;
    tests)
        step gpu_tests 150 "$py" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -rA -s
        ;;
    llama)
        step gpu_llama ${LLAMA_LIMIT:-330} "$py" -m benchmarks.gpu_llama --device cuda --size 1b \
            --out "$out/files" ${LLAMA_EXTRA:---compile-budget 0.5}
        ;;
    shapes)
        step shapes ${SHAPES_LIMIT:-240} "$py" -m benchmarks.shapes --device cuda --steps 0 --text-steps 0 \
            --repeats 5 --out "$out/files/shapes.jsonl" --markdown "$out/files/shapes-cuda.md"
        ;;
    peers)
        limit=${PEERS_LIMIT:-360}
        step peers ${limit} "$py" -m benchmarks.peers --device cuda --size gpu --models "${PEERS_MODELS:-gpt2}" \
            --dtypes "${PEERS_DTYPES:-bf16}" --rounds 3 --duel-rounds 10 --duel-max-rounds 26 --choice-rounds 2 --retries 0 --unit-timeout $((limit - 20)) \
            --compile-seconds ${PEERS_COMPILE_SECONDS:-150} \
            --out "$out/files/peers.jsonl" --markdown "$out/files/peers-cuda.md" ${PEERS_EXTRA:-}
        ;;
    bench)
        step bench_medium ${BENCH_LIMIT:-150} "${bench[@]}" --device cuda --model gpt2 --preset medium \
            --layers preset --batch-size 4 --seq-len 1024 --budget 0.5 --steps 8 --warmup 2 --seeds 1 \
            --no-progress --out "$out/files/bench_medium"
        ;;
    *)
        echo "unknown step $mode: smoke, tests, peers, bench, llama or shapes" >&2
        ;;
    esac
done
cp "$out"/files/*.md "$out"/ 2>/dev/null
tar -czf "$out/results.tar.gz" -C "$out" files
echo "$(date -u +%H:%M:%S) done" | tee -a "$log"
