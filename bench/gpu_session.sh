#!/usr/bin/env bash
# bench/gpu_session.sh: the whole of one GPU session's measurements in one device command.
#
# A GPU session of this workplace has 15 minutes of device time in all (the machine's start, about
# a minute or two, included) and at most 10 minutes per command; a machine starts bare. This script
# is that one command: about 9 minutes, every phase under its own time box, and after every phase
# everything measured so far is packed into $OUT, so a command cut off at its limit still brings
# back what it finished. At most 3 files come back: $OUT/log, $OUT/res.tgz, $OUT/phases.tsv.
#
# Phases, in order (GPU_SESSION_PHASES picks a subset, comma-separated):
#   setup     the carried wheels (.whl/: pydantic and its needs, DeepSpeed, hjson) into /tmp/site;
#             DeepSpeed's cpu_adam C++ op compiled in the background at nice 19 (about a minute,
#             g++ and ninja) into $TORCH_EXTENSIONS_DIR (/tmp/torch_extensions unless set) while the
#             probe runs
#   probe     bench/gpu_probe.py: environment, copies, pinned allocation, host AdamW and CAST rates by
#             thread count, launch cost, matmul rates, a measured HardwareSpec, one ~1B step beside
#             simulate() (probe.json, spec.json, timelines.json, trace.json); its summary says how
#             much of the compute stream's time the GPU was busy with work already issued and how
#             much the ops were still being issued, and the issuing thread's busy and blocked seconds
#   block     bench/gpu_block.py: a 1B- and a 7B-shaped decoder block (GPU_SESSION_BLOCK_SHAPES, default
#             "1b,7b") as megatrain's template, compiled (inductor's cold compile of each shape inside
#             the box: its compile_s is in block.json), compiled in CUDA graphs, the template in CUDA
#             graphs, and transformers' eager layer: GPU, synced and issuing time and TFLOP/s each
#   hostopt   bench/host_optimizer.py: megatrain's host optimizer step against DeepSpeedCPUAdam and
#             torch fused AdamW, same tiles and threads, and each kernel's and host op's stall of the
#             issuing thread (issuing_thread, stall_target: the default kernel under 5%) (after the
#             cpu_adam compile has finished)
#   compare   bench/compare.py at 1B, global batch 16, seq 2048: megatrain on its own plan (the solver
#             chooses the micro-batch size and count too: megatrain-own-plan), then DeepSpeed ZeRO-3
#             with parameters and optimizer offloaded to the CPU at micro-batch 2 x 8, then megatrain
#             at that same 2 x 8 split (the first session's, for continuity); same model, batches and
#             accounting, each system in a box of its own
#   tests     the CUDA tests and the race detector on real streams, in the time that is left
#
# Usage
#   on the device machine (device `run`, carry [".whl"], timeout_s 600):
#       bash bench/gpu_session.sh
#   here, on any CPU, to check the harness before spending device minutes (tiny sizes, CPU paths):
#       bash bench/gpu_session.sh --dry-run            # $OUT defaults to a new temporary directory
#
# Time boxes (seconds) can be changed per phase with GPU_SESSION_LIMIT_<PHASE>=S (e.g.
# GPU_SESSION_LIMIT_PROBE=200, GPU_SESSION_LIMIT_COMPARE_MEGATRAIN_OWN_PLAN=120: upper case, "-" as "_"); a phase past its box is killed (exit 124 in phases.tsv) and the
# next phase runs (the default boxes, probe 230 + block 180 + hostopt 60 + compare 170 s, sum past the
# budget: the last phases get what is left; GPU_SESSION_BLOCK_SHAPES=1b halves the block phase).
# GPU_SESSION_BUDGET_S (default 540) is the whole command's budget: a phase never
# gets more than what is left of it, and the tests phase only what the others left.
# GPU_SESSION_COMPARE_SIZES (default 1b), GPU_SESSION_COMPARE_WARMUP (2) and GPU_SESSION_COMPARE_STEPS
# (5) set the compare phase's model size and steps; GPU_SESSION_COMPARE_SYSTEMS (default "megatrain-own-plan
# deepspeed megatrain"; also fsdp2, torch) its systems, each in a box of its own. At 1B on an H100
# (2026-11-27) DeepSpeed's 7 steps took 100 s of its 170 s box: at 3B take 1 warm-up and 3 steps.
# GPU_SESSION_COMPARE_SEQ_LEN (2048), GPU_SESSION_COMPARE_GLOBAL_BATCH (16), GPU_SESSION_COMPARE_MICRO_BATCH
# (2: the peers' and megatrain's fixed split; megatrain-own-plan chooses its own) and
# GPU_SESSION_COMPARE_BOX_S (170, each system's box) set the rest; the dry run prints each system's GPU
# command. Issue 40 step 2 (3B against DeepSpeed and FSDP2), one command per sequence length:
#   GPU_SESSION_PHASES=setup,compare GPU_SESSION_COMPARE_SIZES=3b GPU_SESSION_COMPARE_WARMUP=1
#   GPU_SESSION_COMPARE_STEPS=3 GPU_SESSION_COMPARE_SYSTEMS="megatrain-own-plan deepspeed fsdp2"
#   GPU_SESSION_COMPARE_BOX_S=170 GPU_SESSION_COMPARE_SEQ_LEN=2048 (then 4096) bash bench/gpu_session.sh
# Issue 40 step 3 (7B-8B, megatrain alone; DeepSpeed's row is its skip, with its 18 B/param host
# estimate), one command per shape; the batches are where `megatrain plan` on the H200 preset with
# 128 GiB of host memory stops gaining tokens/s in one pass (2026-12-03, this CPU: qwen2.5-7b at seq
# 1024 plans 32 x 1, 9,087 tokens/s predicted, 90 GiB of host memory; llama-3-8b at seq 4096 8 x 1,
# 7,696, 94 GiB; bench/README.md):
#   GPU_SESSION_PHASES=setup,compare GPU_SESSION_COMPARE_SIZES=qwen2.5-7b GPU_SESSION_COMPARE_SEQ_LEN=1024
#   GPU_SESSION_COMPARE_GLOBAL_BATCH=32 GPU_SESSION_COMPARE_MICRO_BATCH=32 GPU_SESSION_COMPARE_WARMUP=1
#   GPU_SESSION_COMPARE_STEPS=3 GPU_SESSION_COMPARE_SYSTEMS="megatrain-own-plan deepspeed"
#   GPU_SESSION_COMPARE_BOX_S=400 bash bench/gpu_session.sh
#   (then GPU_SESSION_COMPARE_SIZES=llama-3-8b GPU_SESSION_COMPARE_SEQ_LEN=4096 GPU_SESSION_COMPARE_GLOBAL_BATCH=8
#   GPU_SESSION_COMPARE_MICRO_BATCH=8); each row also gives TFLOPS as MegaTrain counts them (6 N, padded tokens).
# Issue 40 step 5 (the longest context): qwen2.5-7b, one sequence, megatrain alone; the row's
# megatrain_plan holds the plan's GPU peak and host bytes beside the measured ones. On the H200 preset
# with 128 GiB `megatrain plan` fits 512k tokens (838 s a step predicted: past one command's 10
# minutes), 256k in 223 s and 128k in 63 s (2026-12-03, this CPU), so 128k first, then 256k:
#   GPU_SESSION_PHASES=setup,compare GPU_SESSION_COMPARE_SIZES=qwen2.5-7b GPU_SESSION_COMPARE_SEQ_LEN=131072
#   GPU_SESSION_COMPARE_GLOBAL_BATCH=1 GPU_SESSION_COMPARE_MICRO_BATCH=1 GPU_SESSION_COMPARE_WARMUP=0
#   GPU_SESSION_COMPARE_STEPS=2 GPU_SESSION_COMPARE_SYSTEMS=megatrain-own-plan GPU_SESSION_COMPARE_BOX_S=500
#   bash bench/gpu_session.sh        (then _SEQ_LEN=262144 _STEPS=1)
# GPU_SESSION_HANG=<phase> replaces that phase's command by one that never ends, to check on a CPU
# that a hung phase is cut at its box and the later phases still run and pack.
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONUNBUFFERED=1
OUT=${OUT:-}
if [ -z "$OUT" ]; then
    OUT=$(mktemp -d /tmp/gpu_session.XXXXXX)
fi
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpu_session_work.XXXXXX)  # results, packed into $OUT/res.tgz after every phase
BUDGET=${GPU_SESSION_BUDGET_S:-540}
PHASES=${GPU_SESSION_PHASES:-setup,probe,block,hostopt,compare,tests}
if [ $DRY = 1 ]; then
    PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
else
    PY=${PYTHON:-python3}
fi
exec > >(tee "$OUT/log") 2>&1
printf 'phase\trc\tseconds\tbox_s\n' > "$OUT/phases.tsv"
echo "gpu_session: dry=$DRY out=$OUT budget=${BUDGET}s phases=$PHASES python=$PY"

pack() {  # everything under $W into $OUT/res.tgz, atomically (a cut-off tar leaves the last one)
    tar czf "$OUT/res.tgz.tmp" -C "$W" . && mv "$OUT/res.tgz.tmp" "$OUT/res.tgz"
    echo "[t=${SECONDS}s] $1 packed"
}
want() { case ",$PHASES," in *",$1,"*) return 0;; esac; return 1; }
left() { echo $((BUDGET - SECONDS)); }
box() {  # box PHASE DEFAULT_S cmd...: run cmd under min(DEFAULT_S or its override, what is left)
    local phase=$1 default=$2; shift 2
    local var="GPU_SESSION_LIMIT_$(echo "$phase" | tr '[:lower:]-' '[:upper:]_')"
    local s=${!var:-$default} t0=$SECONDS rc
    [ "$s" -gt "$(left)" ] && s=$(left)
    if [ "$s" -le 5 ]; then
        printf '%s\tskipped\t0\t%s\n' "$phase" "$s" >> "$OUT/phases.tsv"; echo "[$phase] skipped: ${s}s left"; return 0
    fi
    echo "[t=${SECONDS}s] $phase: box ${s}s"
    if [ "${GPU_SESSION_HANG:-}" = "$phase" ]; then
        set -- sleep 1000000  # a hang injected to check the time box (tests/test_gpu_session.py)
    fi
    timeout -k 10 "$s" "$@"; rc=$?
    printf '%s\t%s\t%s\t%s\n' "$phase" "$rc" $((SECONDS - t0)) "$s" >> "$OUT/phases.tsv"
    cp "$OUT/phases.tsv" "$W/phases.tsv"
    pack "$phase (rc=$rc)"
    return 0
}

# -- setup -----------------------------------------------------------------------------------------
JIT_PID=
if want setup; then
    if [ $DRY = 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "setup: the carried wheels did not install (carry .whl)"; exit 2; }
        export PYTHONPATH=/tmp/site:$ROOT PATH=/tmp/site/bin:$PATH DS_SKIP_CUDA_CHECK=1
        # One build cache for the background compile, megatrain's loader and the DeepSpeed baseline.
        export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
        ln -sfn ../examples megatrain/examples  # megatrain.examples as the installed package maps it
        nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    fi
    nproc; free -g | head -2
    # cpu_adam compiles at nice 19 beside the probe; a killed compile leaves a lock that blocks the next
    if "$PY" -c "import deepspeed" 2>/dev/null; then
        # Through megatrain's loader: its build cache (the virtual environment's in a dry run, not the
        # user's shared one), and its lines say what is compiled and how long it took.
        (timeout -s INT 300 nice -n 19 "$PY" -c "import time; t=time.time(); from megatrain.runtime.host_kernels import HostAdamW; HostAdamW('deepspeed'); print('cpu_adam ready s', round(time.time()-t, 1))" > "$W/dsjit.log" 2>&1; echo "rc=$?" >> "$W/dsjit.log") &
        JIT_PID=$!
    else
        echo "deepspeed not importable: no cpu_adam compile" > "$W/dsjit.log"
    fi
fi
wait_jit() {
    [ -n "$JIT_PID" ] && wait "$JIT_PID"
    JIT_PID=
    cat "$W/dsjit.log" 2>/dev/null
    grep -q rc=0 "$W/dsjit.log" 2>/dev/null || rm -f "${TORCH_EXTENSIONS_DIR:-/nonexistent}"/cpu_adam/lock \
        ~/.cache/torch_extensions/*/cpu_adam/lock
}

DRYFLAG=(); [ $DRY = 1 ] && DRYFLAG=(--dry-run)

# -- probe: calibration and one measured step beside simulate() --------------------------------------
if want probe; then
    if [ $DRY = 1 ]; then
        box probe 240 "$PY" bench/gpu_probe.py --dry-run --out "$W/probe" --budget-s 200 \
            --sections environment,host_rates,launch,matmul,spec,step
    else
        box probe 230 "$PY" bench/gpu_probe.py --out "$W/probe" --budget-s 210 --steps 5 \
            --sections environment,copies,pinned_alloc,host_rates,launch,matmul,spec,step
    fi
fi

# -- block: where a block's compute time goes (template, compiled, CUDA graphs, eager) -----------------
# The box holds both shapes' cold inductor compiles (block.json says each compile_s); the JSON is
# rewritten after every variant, so a cut keeps what finished (1b first).
if want block; then
    if [ $DRY = 1 ]; then
        box block 300 "$PY" bench/gpu_block.py --dry-run --out "$W/block.json"
    else
        box block 180 "$PY" bench/gpu_block.py --shapes "${GPU_SESSION_BLOCK_SHAPES:-1b,7b}" --out "$W/block.json"
    fi
fi

# -- hostopt: megatrain's host optimizer step against DeepSpeedCPUAdam and torch fused AdamW ---------
if want hostopt; then
    wait_jit
    box hostopt 80 "$PY" bench/host_optimizer.py "${DRYFLAG[@]}" --out "$W/host_optimizer.json"
fi

# -- compare: megatrain and DeepSpeed ZeRO-3 offload, same batches (1B unless told) -----------------
COMPARE_SIZES=${GPU_SESSION_COMPARE_SIZES:-1b}
COMPARE_WARMUP=${GPU_SESSION_COMPARE_WARMUP:-2}
COMPARE_STEPS=${GPU_SESSION_COMPARE_STEPS:-5}
COMPARE_SYSTEMS=${GPU_SESSION_COMPARE_SYSTEMS:-megatrain-own-plan deepspeed megatrain}
COMPARE_SEQ_LEN=${GPU_SESSION_COMPARE_SEQ_LEN:-2048}
COMPARE_GLOBAL_BATCH=${GPU_SESSION_COMPARE_GLOBAL_BATCH:-16}
COMPARE_MICRO_BATCH=${GPU_SESSION_COMPARE_MICRO_BATCH:-2}
COMPARE_BOX=${GPU_SESSION_COMPARE_BOX_S:-170}
if want compare; then
    wait_jit
    mkdir -p "$W/compare"
    for system in $COMPARE_SYSTEMS; do
        gpu_args=(bench/compare.py --sizes "$COMPARE_SIZES" --system "$system" --seq-len "$COMPARE_SEQ_LEN"
                  --global-batch "$COMPARE_GLOBAL_BATCH" --micro-batch "$COMPARE_MICRO_BATCH"
                  --warmup "$COMPARE_WARMUP" --steps "$COMPARE_STEPS" --child-timeout $((COMPARE_BOX - 10))
                  --results-dir "$W/compare")
        if [ $DRY = 1 ]; then
            echo "compare_$system on a GPU (box ${COMPARE_BOX}s): $PY ${gpu_args[*]}"
            case $system in megatrain*) ;; *) continue ;; esac  # the peers need CUDA; the dry run checks the harness
            box "compare_$system" 150 "$PY" bench/compare.py --dry-run --sizes "$COMPARE_SIZES" --system "$system" \
                --results-dir "$W/compare"
        else
            box "compare_$system" "$COMPARE_BOX" "$PY" "${gpu_args[@]}"
        fi
    done
fi

# -- tests: the CUDA tests and the race detector in what is left --------------------------------------
if want tests; then
    L=$(( $(left) - 15 ))
    if [ $DRY = 1 ]; then
        box tests "$L" "$PY" bench/gpu_probe.py --dry-run --out "$W/tests" --budget-s "$L" --sections race_detector
    else
        box tests "$L" "$PY" bench/gpu_probe.py --out "$W/tests" --budget-s "$L" \
            --limit cuda_tests=$((L * 6 / 10)) --sections cuda_tests,race_detector
    fi
fi
wait_jit >/dev/null 2>&1
pack end
echo "gpu_session: done in ${SECONDS}s; $OUT holds log, phases.tsv, res.tgz"
