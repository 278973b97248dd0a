#!/usr/bin/env bash
# The GPU benchmark of issue 40: every run below, each its own process, on one H100 / H200.
# All of them take about 20 minutes; pick some with RUNS to fit a 10-minute command. On an
# H200 (2026-11-27): forms_vit_bf16 122 s, forms_vivit_b1 60 s, forms_vit_bf16_triton_gemm
# 38 s, vit_b16_b64_torch 43 s; forms_vit_train needs about 150 s (MoNE's training step
# compiles in 53 s), forms_vit_f32 about 60 s; the kernel check over 60 s (its float32 half alone took 60).
# On an H200 (2026-11-28, docs/gpu_runs/2026-11-28-*): forms_vit_bf16 with FORMS="present,packed" 82 s,
# kernel_tiles 48 s, forms_vit_bf16_tuned 24 s, forms_vivit_b1_highest 87 s, forms_vivit_b1 35 s,
# forms_vit_train 77 s, forms_vit_f32 (present) 44 s, vit_b16_b256_torch(_fused_mlp) 35-37 s,
# vit_b16_b64_torch 32 s; triton_mlp 17 s without --sweep, over 80 s with it (TRITON_MLP_ARGS; since
# 2026-11-28 the default is "--sweep --budget 60": the sweep stops after about a minute and names what it left).
#
#   bash bench/gpu.sh                  # from the repository root or anywhere
#   OUT=/some/dir bash bench/gpu.sh    # results under $OUT/gpu_bench (default: runs/gpu_bench)
#
# For a bare GPU machine whose image has jax with CUDA, torch and timm but not
# keras / namex / optree: whatever of keras_mone's imports is missing is
# installed from the wheels in $WHEELS (default: wheels/, made beforehand with
# `pip download keras namex optree -d wheels/ --no-deps`), else from the package
# index if it is reachable. keras_mone itself runs from this checkout
# (PYTHONPATH), not installed.
#
# First bench/kernel_check.py: the fused kernels (kernels/), compiled for the card, against
# the plain path (kernel_check.md; with RUNS set, only if RUNS names kernel_check: it took
# over 60 s on an H200; a failed check fails the exit status). Then runs, each its own
# process (dense and MoNE interleaved, medians of $REPEATS):
#   1. jax   ViT-B/16 224, e_c 0.3 and 0.5, batch 64, float32 + mixed_bfloat16:
#            forward on device input and on host input (predict_on_batch), timm peer
#   2. jax   the same at batch 256, device input only, timm peer
#   3. jax   ViT-B/16 e_c 0.3, batch 64, float32: training steps (device input; train_on_batch)
#   4. torch ViT-B/16 e_c 0.3, batch 64, float32, eager: forward on device and host input, timm peer
#  4a. torch ViT-B/16 e_c 0.3, batch 8, float32, eager: forward on device input, timm peer
#      (vit_b16_b8_torch: where the host's time per op shows), and torch_host_time
#      (bench/torch_host_time.py: the host's share of an eager forward on this machine's CPU)
#  4b. torch ViT-B/16 e_c 0.3, batch 256, mixed_bfloat16, eager, under torch.compile and under
#      torch.compile(mode="reduce-overhead") (CUDA graphs), timm peer
#      (vit_b16_b256_torch_compile, 540 s: inductor compiles each model twice)
#      vit_b16_b256_torch_compiled: the same under the default mode only, without timm (each model compiled once)
#  4c. torch ViT-B/16 e_c 0.3, batch 256, mixed_bfloat16, eager (vit_b16_b256_torch), and the same
#      with the nested MLPs through the Triton kernel (vit_b16_b256_torch_fused_mlp, KERAS_MONE_MLP=fused);
#      triton_mlp: that kernel against torch's ops per nested group, with its tile grid (bench/triton_mlp.py)
#  4d. torch ViT-B/16 e_c 0.3 with each nested projection one Triton launch over all token groups
#      (KERAS_MONE_PROJECTIONS=grouped_kernel): triton_grouped_tiles (bench/triton_grouped_tiles.py: its tiles
#      against torch's per-group ops, each checked), then vit_b16_b256_torch_grouped (eager, bf16, batch 256,
#      the screen's winners), vit_b16_b64_torch_grouped (eager, float32, batch 64) and
#      vit_b16_b256_torch_compiled_grouped (torch.compile's default mode, bf16, batch 256); the two eager runs
#      again with a statistics kernel per LayerNorm (*_row_kernel, KERAS_MONE_STATISTICS=kernel) in place
#      of the out-projections' partial statistics
#   5. jax   ViViT-FE-B/16 32x256x256, e_c 0.4, batch 1, float32, device input
#   6. jax   ViViT-FE-B/16 32x256x256, e_c 0.3, batch 8, float32 + mixed_bfloat16, device input
#   7. jax   run 1 at e_c 0.3, mixed_bfloat16, device input, with the CPU's explicit attention
#            (KERAS_MONE_ATTENTION=explicit) against the GPU's fused default
#   8. jax   ViT-B/16 e_c 0.3, batch 64, float32 + mixed_bfloat16, device input, with the
#            nested MLP as one Pallas kernel per token group (KERAS_MONE_MLP=fused)
#   9. jax   the same at batch 256, mixed_bfloat16
#  10. jax   the same at batch 64, mixed_bfloat16: training steps through the kernel
#  11. jax   run 5 (ViViT-FE-B/16, batch 1) through the kernels
# and the form sweeps of bench/gpu_forms.py (one process each: every form of
# layers.platform_forms compiled and timed against the dense model, with a jax.profiler
# table of where the device time goes):
#  forms_vit_bf16    ViT-B/16 e_c 0.3, mixed_bfloat16, batch 64 and 256, timm peer, profile
#  forms_vit_f32     the same in float32 at batch 64
#  forms_vit_train   training steps, mixed_bfloat16, batch 128
#  weight_gradient_tiles  the training step's grouped weight-gradient kernel (dW and db of each nested
#                    weight in one launch) timed against XLA's per-group products, each setting checked
#                    first (bench/weight_gradient_tiles.py, bf16, batch 128); its winners become
#                    KERAS_MONE_WEIGHT_GRADIENT_TILES for forms_vit_train_grouped
#  forms_vit_train_grouped  the same, present against grouped_kernel (its backward passes grouped kernels too)
#                    and grouped_kernel_all (the dense model's training step through them too)
#  forms_vit_bf16_triton_gemm   batch 256 with XLA_FLAGS=--xla_gpu_triton_gemm_any=true
#  forms_vit_bf16_tanh  batch 256, both models with the tanh GELU of the AugReg presets (--gelu-approximate)
#  forms_vit_bf16_tanh_cublaslt  the same with every GEMM cuBLAS's and cuBLASLt on
#                    (XLA_FLAGS): the GELU in fc1's epilogue
#  kernel_tiles      the block kernel's tile settings timed against XLA, each one's output
#                    checked against it (bench/kernel_tiles.py)
#  forms_vit_bf16_tuned  batch 256, fused_mlp with the best tiles of kernel_tiles (XLA's path at
#                    a width where no tile beat it)
#  kernel_tiles_mlp  the same screen for the MLP kernel alone (bench/kernel_tiles.py --kernel mlp)
#  forms_vit_bf16_mlp_tuned  batch 256, mlp_kernel (KERAS_MONE_MLP=mlp_kernel) with its best tiles
#  grouped_tiles     the grouped nested projections' tiles (KERAS_MONE_PROJECTIONS=grouped_kernel: one
#                    Pallas launch per projection over all token groups) timed against XLA's per-group
#                    GEMMs, each one's output checked first (bench/grouped_tiles.py, bf16); its winners
#                    become KERAS_MONE_PROJECTION_TILES for forms_vit_grouped
#  forms_vit_grouped      ViT-B/16 e_c 0.3, mixed_bfloat16, batch 64 and 256: present against grouped_kernel,
#                    grouped_kernel_all (the dense model through the same kernels) and
#                    grouped_kernel+kernel_statistics (kernels.row_statistics), timm peer, profile
#  attention_tiles   the flash-attention kernel's tiles (kernels.flash_attention) timed against XLA's
#                    attention in float32, each one's output checked first (bench/attention_tiles.py);
#                    its winners become KERAS_MONE_ATTENTION_TILES for the float32 *_grouped sweeps
#  forms_vit_f32_grouped  the same in float32 at batch 64, also with flash attention
#                    (grouped_kernel+flash_attention: KERAS_MONE_ATTENTION=flash, kernels.flash_attention), and
#                    with the statistics kernel too
#  forms_vivit_b1_grouped ViViT-FE-B/16 e_c 0.4, float32, batch 1, present against grouped_kernel and
#                    grouped_kernel+flash_attention, profile
#  forms_vivit_b8_grouped ViViT-FE-B/16 e_c 0.3, float32, batch 8, the same forms
#  forms_vivit_b1    ViViT-FE-B/16 e_c 0.4, float32, batch 1, profile
#  forms_vivit_b1_highest  the same without TF32 (--matmul-precision highest), as MoNE Table 1
#                    timed it on a V100: compute-bound, the roofline bound 1.97x (bench/gpu_program.py)
# and writes $OUT_DIR/gpu_bench.md: the combined table, then every run's full
# report (with the card's name, versions and command line); each run's JSON,
# markdown, plot and log lie in $OUT_DIR/<run>/.
#
# Knobs: RUNS (names of the runs to do, e.g. RUNS="vit_b16_b256 vit_b16_b256_fused_mlp" to
# split the table over two calls of a machine that allows 10 minutes per command; default
# all), REPEATS (10), STEP_TIMEOUT (seconds per run, 150; TIMEOUT_<run> for one run, e.g.
# TIMEOUT_forms_vit_bf16=200, TIMEOUT_kernel_check=60, TIMEOUT_kernel_tiles_mlp=90), FORMS / FORMS_F32 / FORMS_TRAIN /
# FORMS_VIVIT (the forms of each sweep), FORMS_EXTRA (appended to every sweep), TORCH_COMPILE=1
# (run 4 also under torch.compile, default and reduce-overhead: adds minutes), WHEELS, and
# FORMS_GROUPED / FORMS_GROUPED_F32 (the forms of the bf16 / float32 *_grouped sweeps), GROUPED_TILES_ARGS (for bench/grouped_tiles.py),
# TRITON_GROUPED_TILES_ARGS (for bench/triton_grouped_tiles.py), PROJECTIONS (KERAS_MONE_PROJECTIONS of a bench run),
# WEIGHT_TILES_ARGS (for bench/weight_gradient_tiles.py), ATTENTION_TILES_ARGS (for bench/attention_tiles.py),
# KERNEL_CHECK_ARGS (for bench/kernel_check.py; on a CPU, where it is interpreted, e.g.
# "--rows 64 --dim 96 --hidden 384 --widths 12,24"), and
# EXTRA_ARGS, appended to every run (the last of a repeated option wins), e.g.
# a CPU smoke test of the script in a minute or two:
#   EXTRA_ARGS="--image-size 32 --batch-size 2 --repeats 2 --warmup 1 --model-override patch_size=8
#   --model-override hidden_dim=32 --model-override depth=2 --model-override num_heads=4
#   --model-override mlp_dim=64" bash bench/gpu.sh
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/runs}/gpu_bench"
WHEELS="${WHEELS:-$ROOT/wheels}"
REPEATS="${REPEATS:-10}"
STEP_TIMEOUT="${STEP_TIMEOUT:-150}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# torch (timm) shares the GPU with jax in runs 1-2: jax allocates as it goes
# instead of taking 75% of the card up front
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
# runs 1-3 compile the same ViT-B/16 programs in different processes
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/keras_mone_jax_cache}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
start=$SECONDS

# -- 1. what the image lacks ----------------------------------------------------
missing=$("$PYTHON" - <<'EOF'
import importlib.util
packages = {"keras": "keras", "namex": "namex", "optree": "optree", "absl": "absl-py", "rich": "rich",
            "h5py": "h5py", "ml_dtypes": "ml-dtypes", "scipy": "scipy", "matplotlib": "matplotlib",
            "sklearn": "scikit-learn"}
print(" ".join(p for module, p in packages.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "[gpu.sh] installing: $missing"
    # shellcheck disable=SC2086  # one word per package
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" $missing \
        || "$PYTHON" -m pip install -q $missing \
        || { echo "[gpu.sh] could not install $missing (no wheels in $WHEELS, no index)"; exit 1; }
fi
"$PYTHON" - <<'EOF' || exit 1
import importlib.util
for module in ("jax", "torch", "timm"):
    print(f"[gpu.sh] {module}: {'yes' if importlib.util.find_spec(module) else 'NOT INSTALLED'}")
EOF
echo "[gpu.sh] setup done in $((SECONDS - start)) s"

# -- 2. the fused kernels, compiled for this card, against the plain path -------
# (with RUNS set, only if it names kernel_check: kernel_tiles checks each tile it times)
check_rc=0  # a failed (or cut) kernel check fails the exit status, as a failed run does
checked=""  # this call's kernel check, for the combined report (not one an earlier call left)
if [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" kernel_check "* ]]; then
    checked="$OUT_DIR/kernel_check.md"
    # shellcheck disable=SC2086  # KERNEL_CHECK_ARGS: one word per argument
    KERAS_BACKEND=jax timeout "${TIMEOUT_kernel_check:-$STEP_TIMEOUT}" "$PYTHON" "$ROOT/bench/kernel_check.py" \
        ${KERNEL_CHECK_ARGS:-} >"$OUT_DIR/kernel_check.md" 2>"$OUT_DIR/kernel_check.log"
    check_rc=$?
    echo "[gpu.sh] kernel check: exit $check_rc (total $((SECONDS - start)) s)"; cat "$OUT_DIR/kernel_check.md"
    [ "$check_rc" -eq 0 ] || tail -5 "$OUT_DIR/kernel_check.log"
fi

# -- 3. the runs ----------------------------------------------------------------
COMMON=(--repeats "$REPEATS" --warmup 2 --no-routing-probes --no-peer --quiet)
B16=(--variant B/16 --image-size 224)
VIVIT=(--family vivit --variant B/16 --image-size 256 --no-timm --no-train-step --no-host-input)
runs=()

selected=0
bench() {  # bench NAME BACKEND ARGS...: one `keras-mone bench` process
    local name="$1" backend="$2"
    shift 2
    # RUNS: the run names to do (space-separated), default all
    [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]] && return 0
    selected=$((selected + 1))
    local t0=$SECONDS
    mkdir -p "$OUT_DIR/$name"
    local limit="TIMEOUT_$name"  # e.g. TIMEOUT_vit_b16_b64=200; default STEP_TIMEOUT
    # shellcheck disable=SC2086  # EXTRA_ARGS: one word per argument
    KERAS_MONE_ATTENTION="${ATTENTION:-}" KERAS_MONE_MLP="${MLP:-}" KERAS_MONE_PROJECTIONS="${PROJECTIONS:-}" \
        KERAS_BACKEND="$backend" \
        timeout "${!limit:-$STEP_TIMEOUT}" "$PYTHON" -m keras_mone.cli.main bench "$@" "${COMMON[@]}" \
        --output "$OUT_DIR/$name" ${EXTRA_ARGS:-} >"$OUT_DIR/$name/log.txt" 2>&1
    local rc=$?
    echo "[gpu.sh] $name ($backend): exit $rc in $((SECONDS - t0)) s (total $((SECONDS - start)) s)"
    [ "$rc" -eq 0 ] && runs+=("$OUT_DIR/$name/benchmark.json") || tail -5 "$OUT_DIR/$name/log.txt"
}

bench vit_b16_b64 jax "${B16[@]}" --capacities 0.3,0.5 --batch-size 64 \
    --precision float32,mixed_bfloat16 --no-train-step
bench vit_b16_b256 jax "${B16[@]}" --capacities 0.3,0.5 --batch-size 256 \
    --precision float32,mixed_bfloat16 --no-train-step --no-host-input
bench vit_b16_b64_train jax "${B16[@]}" --capacities 0.3 --batch-size 64 --precision float32 --no-timm
torch_extra=()
[ "${TORCH_COMPILE:-0}" = 1 ] && torch_extra=(--torch-compile default,reduce-overhead)
bench vit_b16_b64_torch torch "${B16[@]}" --capacities 0.3 --batch-size 64 --precision float32 \
    --no-train-step "${torch_extra[@]}"
bench vit_b16_b8_torch torch "${B16[@]}" --capacities 0.3 --batch-size 8 --precision float32 \
    --no-train-step --no-host-input
# issue 40's torch target: batch 256, bf16, under torch.compile (inductor compiles each model for minutes)
TIMEOUT_vit_b16_b256_torch_compile="${TIMEOUT_vit_b16_b256_torch_compile:-540}" bench vit_b16_b256_torch_compile \
    torch "${B16[@]}" --capacities 0.3 --batch-size 256 --precision mixed_bfloat16 --no-train-step --no-host-input \
    --torch-compile default,reduce-overhead
# the same under torch.compile's default mode only (Keras' jit_compile=True): each model compiled once
# (on this machine's CPU, ViT-B/16 float32: dense 23 s, MoNE 47 s), so it fits a call with other runs
TIMEOUT_vit_b16_b256_torch_compiled="${TIMEOUT_vit_b16_b256_torch_compiled:-300}" bench vit_b16_b256_torch_compiled \
    torch "${B16[@]}" --capacities 0.3 --batch-size 256 --precision mixed_bfloat16 --no-train-step --no-host-input \
    --no-timm --torch-compile default
# eager torch, bf16, batch 256: the packed blocks' nested MLPs through torch's ops, then through
# the Triton kernel (KERAS_MONE_MLP=fused on torch: kernels/triton_nested_mlp.py)
bench vit_b16_b256_torch torch "${B16[@]}" --capacities 0.3 --batch-size 256 --precision mixed_bfloat16 \
    --no-train-step --no-host-input
MLP=fused bench vit_b16_b256_torch_fused_mlp torch "${B16[@]}" --capacities 0.3 --batch-size 256 \
    --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm
bench vivit_b16_b1 jax "${VIVIT[@]}" --capacities 0.4 --batch-size 1 --precision float32
bench vivit_b16_b8 jax "${VIVIT[@]}" --capacities 0.3 --batch-size 8 --precision float32,mixed_bfloat16
# the CPU's attention form on the GPU: what the fused kernel (the GPU's default) gains, dense and MoNE alike
ATTENTION=explicit bench vit_b16_b64_explicit_attention jax "${B16[@]}" --capacities 0.3 --batch-size 64 \
    --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm
# the fused nested MLP (kernels/fused_nested_mlp, a Pallas kernel): opt-in until this run shows it pays
MLP=fused bench vit_b16_b64_fused_mlp jax "${B16[@]}" --capacities 0.3 --batch-size 64 \
    --precision float32,mixed_bfloat16 --no-train-step --no-host-input --no-timm
MLP=fused bench vit_b16_b256_fused_mlp jax "${B16[@]}" --capacities 0.3 --batch-size 256 \
    --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm
MLP=fused bench vit_b16_b64_fused_mlp_train jax "${B16[@]}" --capacities 0.3 --batch-size 64 \
    --precision mixed_bfloat16 --no-host-input --no-timm
MLP=fused bench vivit_b16_b1_fused_mlp jax "${VIVIT[@]}" --capacities 0.4 --batch-size 1 --precision float32

forms() {  # forms NAME ARGS...: one bench/gpu_forms.py process (jax)
    local name="$1"
    shift
    [ -n "${RUNS:-}" ] && [[ " $RUNS " != *" $name "* ]] && return 0
    selected=$((selected + 1))
    local t0=$SECONDS
    mkdir -p "$OUT_DIR/$name"
    local limit="TIMEOUT_$name"  # e.g. TIMEOUT_forms_vit_bf16=200; default STEP_TIMEOUT
    # shellcheck disable=SC2086  # FORMS_EXTRA: one word per argument
    KERAS_BACKEND=jax timeout "${!limit:-$STEP_TIMEOUT}" "$PYTHON" "$ROOT/bench/gpu_forms.py" "$@" \
        --output "$OUT_DIR/$name" ${FORMS_EXTRA:-} >"$OUT_DIR/$name/log.txt" 2>&1
    local rc=$?
    echo "[gpu.sh] $name (jax forms): exit $rc in $((SECONDS - t0)) s (total $((SECONDS - start)) s)"
    # a sweep cut short by its timeout keeps the rows it wrote
    [ -f "$OUT_DIR/$name/gpu_forms.md" ] && forms_reports+=("$OUT_DIR/$name/gpu_forms.md") \
        && grep -E "^\| (forward|train step|timm|\*\*total|kernels per call|[a-z]+ \|)" "$OUT_DIR/$name/gpu_forms.md" \
        | grep -v "^| kernel |" | head -40
    [ "$rc" -eq 0 ] && forms_done=$((forms_done + 1)) || tail -5 "$OUT_DIR/$name/log.txt"
}
forms_reports=()
script_reports=()  # the reports of the tile screens, triton_mlp and torch_host_time
scripts_done=0
script_run() {  # script_run NAME PATTERN COMMAND...: a selected script, its report (stdout) and log (stderr)
    local name="$1" pattern="$2" limit="TIMEOUT_$1" rc
    shift 2
    { [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $name "* ]]; } || return 0
    selected=$((selected + 1))
    timeout "${!limit:-$STEP_TIMEOUT}" "$@" >"$OUT_DIR/$name.md" 2>"$OUT_DIR/$name.log"
    rc=$?
    echo "[gpu.sh] $name: exit $rc (total $((SECONDS - start)) s)"
    [ "$rc" -eq 0 ] && scripts_done=$((scripts_done + 1))
    grep -E "$pattern" "$OUT_DIR/$name.md"  # its highlights (the rows of a run cut short included)
    script_reports+=("$OUT_DIR/$name.md")
}
forms_done=0
FORMS="${FORMS:-present,keras_statistics,fused_statistics,half_block_residuals,packed}"
# (fused_mlp: forms_vit_bf16_tuned; six forms took about 150 s on an H200, two 82 s)
TIMEOUT_forms_vit_bf16="${TIMEOUT_forms_vit_bf16:-220}"
TIMEOUT_forms_vit_train="${TIMEOUT_forms_vit_train:-240}"  # one form took 77 s; MoNE's step compiles in 53
forms forms_vit_bf16 --batch-sizes 64,256 --forms "$FORMS" --profile --timm
forms forms_vit_f32 --batch-sizes 64 --precision float32 --forms "${FORMS_F32:-present,library_gelu+patch_conv}" --timm
forms forms_vit_train --batch-sizes "" --train-batch 128 --train-forms "${FORMS_TRAIN:-present,keras_statistics}"
# the training step through the grouped kernels, forward and backward (kernels.grouped_gradients): the
# weight-gradient kernel's tiles first (a KERAS_MONE_WEIGHT_GRADIENT_TILES set beforehand wins)
# shellcheck disable=SC2086  # WEIGHT_TILES_ARGS: one word per argument
script_run weight_gradient_tiles "best|no tile setting|KERAS_MONE_WEIGHT_GRADIENT_TILES" \
    env KERAS_BACKEND=jax "$PYTHON" "$ROOT/bench/weight_gradient_tiles.py" ${WEIGHT_TILES_ARGS:---budget 80}
weight_tiles=$(grep -o 'KERAS_MONE_WEIGHT_GRADIENT_TILES="[^"]*"' "$OUT_DIR/weight_gradient_tiles.md" 2>/dev/null \
    | cut -d'"' -f2)
TIMEOUT_forms_vit_train_grouped="${TIMEOUT_forms_vit_train_grouped:-300}"
KERAS_MONE_WEIGHT_GRADIENT_TILES="${KERAS_MONE_WEIGHT_GRADIENT_TILES:-$weight_tiles}" \
    forms forms_vit_train_grouped --batch-sizes "" --train-batch 128 \
    --train-forms "${FORMS_TRAIN_GROUPED:-present,grouped_kernel,grouped_kernel_all}"
# XLA's Triton GEMMs for every dot (they can take elementwise prologues such as the GELU)
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_triton_gemm_any=true" forms forms_vit_bf16_triton_gemm --batch-sizes 256 \
    --forms "${FORMS_TRITON:-present}"
# the tanh GELU of the AugReg presets (gelu_approximate, both models), under XLA's default GEMMs and with
# every GEMM cuBLAS's, where cuBLASLt takes the GELU into fc1's epilogue (compiled for an H200 without
# one: the hidden activations' GELU pass gone, both models' roofline 18% lower; BENCHMARKS.md)
forms forms_vit_bf16_tanh --batch-sizes 256 --forms present --gelu-approximate --profile
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true" \
    forms forms_vit_bf16_tanh_cublaslt --batch-sizes 256 --forms present --gelu-approximate --profile
tuned_forms() {  # tuned_forms TILES_RUN KERNEL FORMS_RUN FORM: a kernel's tiles, then the model with the best
    local tiles_run="$1" kernel="$2" forms_run="$3" form="$4" tuned
    # shellcheck disable=SC2086  # KERNEL_TILES_ARGS: one word per argument
    script_run "$tiles_run" "best|no tile setting|faster than every tile|KERAS_MONE_MLP_TILES" \
        env KERAS_BACKEND=jax "$PYTHON" "$ROOT/bench/kernel_tiles.py" --kernel "$kernel" ${KERNEL_TILES_ARGS:-}
    tuned=$(grep -o 'KERAS_MONE_MLP_TILES="[^"]*"' "$OUT_DIR/$tiles_run.md" 2>/dev/null | cut -d'"' -f2)
    if [ -z "${KERAS_MONE_MLP_TILES:-}$tuned" ] && { [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $forms_run "* ]]; }; then
        echo "[gpu.sh] $forms_run: no tiles from $tiles_run (not run, or cut short): the kernel's defaults"
    fi
    # a KERAS_MONE_MLP_TILES set beforehand overrides the screen's winners
    KERAS_MONE_MLP_TILES="${KERAS_MONE_MLP_TILES:-$tuned}" forms "$forms_run" --batch-sizes 256 \
        --forms "present,$form"
}
# the host's share of an eager torch forward on this machine's CPU (seconds: tiny models)
script_run torch_host_time "." env KERAS_TORCH_DEVICE=cpu KERAS_BACKEND=torch "$PYTHON" "$ROOT/bench/torch_host_time.py"
# the Triton MLP kernel (torch) against torch's ops per nested group of ViT-B/16 at batch 256, bf16,
# with its tile grid (rows print as they are measured: a run cut short keeps them)
# shellcheck disable=SC2086  # TRITON_MLP_ARGS: one word per argument
script_run triton_mlp "^- d = |KERAS_MONE_MLP_TILES|No setting" \
    env KERAS_BACKEND=torch "$PYTHON" "$ROOT/bench/triton_mlp.py" ${TRITON_MLP_ARGS:---sweep --budget 60}
# the host time of each Triton call, whole calls at batch 1 (bench/triton_launch_host.py --launch: the wrapper and
# Triton's launcher; an eager MoNE-ViT-B/16 forward makes 72 such calls)
script_run triton_launch_host "^\| " env KERAS_BACKEND=torch "$PYTHON" "$ROOT/bench/triton_launch_host.py" --launch
# torch's packed blocks with each nested projection one Triton launch over all token groups
# (KERAS_MONE_PROJECTIONS=grouped_kernel on torch: kernels/triton_grouped_projection.py, layers/packed_kernels.py):
# its tiles against torch's per-group ops first (bench/triton_grouped_tiles.py, bf16, batch 256, each setting
# checked), then MoNE-ViT-B/16 against dense with the winners (a KERAS_MONE_PROJECTION_TILES set beforehand
# wins): eager bf16 at batch 256, eager float32 at batch 64, and under torch.compile at batch 256
# shellcheck disable=SC2086  # TRITON_GROUPED_TILES_ARGS: one word per argument
script_run triton_grouped_tiles "best|no tile setting|KERAS_MONE_PROJECTION_TILES" \
    env KERAS_BACKEND=torch "$PYTHON" "$ROOT/bench/triton_grouped_tiles.py" ${TRITON_GROUPED_TILES_ARGS:---budget 60}
torch_grouped_tiles=$(grep -o 'KERAS_MONE_PROJECTION_TILES="[^"]*"' "$OUT_DIR/triton_grouped_tiles.md" 2>/dev/null \
    | cut -d'"' -f2)
KERAS_MONE_PROJECTION_TILES="${KERAS_MONE_PROJECTION_TILES:-$torch_grouped_tiles}" PROJECTIONS=grouped_kernel \
    bench vit_b16_b256_torch_grouped torch "${B16[@]}" --capacities 0.3 --batch-size 256 \
    --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm
PROJECTIONS=grouped_kernel bench vit_b16_b64_torch_grouped torch "${B16[@]}" --capacities 0.3 --batch-size 64 \
    --precision float32 --no-train-step --no-host-input --no-timm
# the same two with each LayerNorm's statistics by a kernel of their own (the form before the partials)
KERAS_MONE_STATISTICS=kernel KERAS_MONE_PROJECTION_TILES="${KERAS_MONE_PROJECTION_TILES:-$torch_grouped_tiles}" \
    PROJECTIONS=grouped_kernel bench vit_b16_b256_torch_grouped_row_kernel torch "${B16[@]}" --capacities 0.3 \
    --batch-size 256 --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm
KERAS_MONE_STATISTICS=kernel PROJECTIONS=grouped_kernel bench vit_b16_b64_torch_grouped_row_kernel torch "${B16[@]}" \
    --capacities 0.3 --batch-size 64 --precision float32 --no-train-step --no-host-input --no-timm
TIMEOUT_vit_b16_b256_torch_compiled_grouped="${TIMEOUT_vit_b16_b256_torch_compiled_grouped:-300}" \
    KERAS_MONE_PROJECTION_TILES="${KERAS_MONE_PROJECTION_TILES:-$torch_grouped_tiles}" PROJECTIONS=grouped_kernel \
    bench vit_b16_b256_torch_compiled_grouped torch "${B16[@]}" --capacities 0.3 --batch-size 256 \
    --precision mixed_bfloat16 --no-train-step --no-host-input --no-timm --torch-compile default
# the block kernel's tiles on this card (bench/kernel_tiles.py), then the model with the best ones;
# then the same for the MLP kernel alone (KERAS_MONE_MLP=mlp_kernel: LayerNorm and residual XLA's)
tuned_forms kernel_tiles residual forms_vit_bf16_tuned fused_mlp
tuned_forms kernel_tiles_mlp mlp forms_vit_bf16_mlp_tuned mlp_kernel
# one Pallas launch per nested projection over all token groups (KERAS_MONE_PROJECTIONS=grouped_kernel,
# layers.grouped_block; compiled for an H200 without one, MoNE-ViT-B/16 bf16 at batch 256: 161 kernels
# against 797, roofline bound 3.07x against 1.66x; BENCHMARKS.md): its tiles first (bench/grouped_tiles.py,
# each checked against XLA's per-group GEMMs), then the models with the winners (a
# KERAS_MONE_PROJECTION_TILES set beforehand wins; each sweep notes how far the kernels' logits lie from
# the present form's)
# shellcheck disable=SC2086  # GROUPED_TILES_ARGS: one word per argument
script_run grouped_tiles "best|no tile setting|KERAS_MONE_PROJECTION_TILES" \
    env KERAS_BACKEND=jax "$PYTHON" "$ROOT/bench/grouped_tiles.py" ${GROUPED_TILES_ARGS:---budget 100}
# (the screen runs in bf16: its winners go to the bf16 sweep only, as a tile that fits shared memory with
# bf16 rows may not with float32 ones; the float32 sweeps take the defaults or a variable set beforehand)
grouped_tiles=$(grep -o 'KERAS_MONE_PROJECTION_TILES="[^"]*"' "$OUT_DIR/grouped_tiles.md" 2>/dev/null | cut -d'"' -f2)
TIMEOUT_forms_vit_grouped="${TIMEOUT_forms_vit_grouped:-260}"
KERAS_MONE_PROJECTION_TILES="${KERAS_MONE_PROJECTION_TILES:-$grouped_tiles}" \
    forms forms_vit_grouped --batch-sizes 64,256 --forms "${FORMS_GROUPED:-present,grouped_kernel,grouped_kernel_all,grouped_kernel+kernel_statistics}" \
    --profile --timm
# in float32 also with attention as one Pallas kernel (KERAS_MONE_ATTENTION=flash: cuDNN takes no float32,
# and XLA's attention writes and rereads the scores; compiled without a card, the bound of ViViT at batch 1
# rises from 1.67x to 2.43x with it, BENCHMARKS.md "Flash attention in float32")
# The flash kernel's tiles first (bench/attention_tiles.py, float32 at TF32, each setting checked against
# XLA's attention; ViViT's spatial and temporal attention at batch 1, ViT-B/16's at batch 64): its winners
# become KERAS_MONE_ATTENTION_TILES for the float32 sweeps (a value set beforehand wins)
# shellcheck disable=SC2086  # ATTENTION_TILES_ARGS: one word per argument
script_run attention_tiles "best|no tile setting|KERAS_MONE_ATTENTION_TILES" \
    env KERAS_BACKEND=jax "$PYTHON" "$ROOT/bench/attention_tiles.py" ${ATTENTION_TILES_ARGS:---budget 50}
attention_tiles=$(grep -o 'KERAS_MONE_ATTENTION_TILES="[^"]*"' "$OUT_DIR/attention_tiles.md" 2>/dev/null | cut -d'"' -f2)
export KERAS_MONE_ATTENTION_TILES="${KERAS_MONE_ATTENTION_TILES:-$attention_tiles}"
# (kernel_statistics: each LayerNorm's mean and rstd by one Pallas kernel, kernels.row_statistics, not a
# reduction and an rsqrt pass of XLA's: ViViT at batch 1 compiled for an H200, 175 kernels against 199)
TIMEOUT_forms_vit_f32_grouped="${TIMEOUT_forms_vit_f32_grouped:-200}"
TIMEOUT_forms_vivit_b1_grouped="${TIMEOUT_forms_vivit_b1_grouped:-240}"
TIMEOUT_forms_vivit_b8_grouped="${TIMEOUT_forms_vivit_b8_grouped:-240}"
forms forms_vit_f32_grouped --batch-sizes 64 --precision float32 \
    --forms "${FORMS_GROUPED_F32:-present,grouped_kernel,grouped_kernel+flash_attention,grouped_kernel_all+flash_attention,grouped_kernel+flash_attention+kernel_statistics}"
forms forms_vivit_b1_grouped --family vivit --capacity 0.4 --batch-sizes 1 --precision float32 \
    --forms "${FORMS_GROUPED_F32:-present,grouped_kernel,grouped_kernel+flash_attention,grouped_kernel_all+flash_attention,grouped_kernel+flash_attention+kernel_statistics}" --profile
forms forms_vivit_b8_grouped --family vivit --capacity 0.3 --batch-sizes 8 --precision float32 \
    --forms "${FORMS_GROUPED_F32:-present,grouped_kernel,grouped_kernel+flash_attention,grouped_kernel_all+flash_attention,grouped_kernel+flash_attention+kernel_statistics}"
forms forms_vivit_b1 --family vivit --capacity 0.4 --batch-sizes 1 --precision float32 \
    --forms "${FORMS_VIVIT:-present,keras_statistics}" --profile
# MoNE Table 1's setting: float32 on a V100, which has no TF32 (matmuls at jax's "highest" precision)
forms forms_vivit_b1_highest --family vivit --capacity 0.4 --batch-sizes 1 --precision float32 \
    --matmul-precision highest --forms present

# -- 4. the report --------------------------------------------------------------
REPORT="$OUT_DIR/gpu_bench.md"
KERNEL_CHECK_REPORT="$checked" SCRIPT_REPORTS="$(IFS=:; echo "${script_reports[*]}")" \
    FORMS_REPORTS="$(IFS=:; echo "${forms_reports[*]}")" KERAS_BACKEND=jax \
    "$PYTHON" - "$REPORT" "$((SECONDS - start))" "${runs[@]}" <<'EOF'
import json
import os
import sys

from keras_mone.bench.report import format_markdown
from keras_mone.bench.tables import combined_table

report, seconds, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
results = [json.load(open(path)) for path in paths]
with open(report, "w") as f:
    sweeps = [path for path in os.environ.get("FORMS_REPORTS", "").split(":") if path]
    f.write(f"# GPU benchmark (bench/gpu.sh, {len(results)} bench runs, {len(sweeps)} form sweeps, {seconds} s)\n\n")
    check = os.environ.get("KERNEL_CHECK_REPORT", "")
    if check and os.path.exists(check):
        f.write(open(check).read() + "\n")
    for path in os.environ.get("SCRIPT_REPORTS", "").split(":"):  # this call's tile screens and host times
        if path and os.path.exists(path):
            f.write(f"## {os.path.basename(path)[:-3]}\n\n" + open(path).read() + "\n")
    if results:
        f.write(combined_table(results) + "\n")
    for path in sweeps:
        if path:
            f.write(f"## {os.path.basename(os.path.dirname(path))}\n\n" + open(path).read() + "\n")
    for result in results:
        f.write(format_markdown(result) + "\n")
print(f"[gpu.sh] wrote {report}")
EOF
echo "[gpu.sh] done in $((SECONDS - start)) s"
[ "$((${#runs[@]} + forms_done + scripts_done))" -eq "$selected" ] && [ "$check_rc" -eq 0 ]
