#!/usr/bin/env bash
# One GPU session's work, highest value first, every result into one folder:
#   bash scripts/gpu_session.sh RESULTS_DIR [BASELINE_TREE]
# RESULTS_DIR gets one log or JSON-lines file per step (and `steps.txt`: which step ran,
# its exit status and seconds); a step that fails or runs out of time does not stop the
# ones after it. BASELINE_TREE: an older checkout of onespec (e.g. `git worktree add
# ../baseline REV`) for the A/B rows, which run the same benchmark on both trees in one
# session. Set STEP_TIMEOUT (seconds, default 600) to bound each step, and STEPS (names,
# space-separated) to run only those steps, e.g. STEPS="long_16k prefix_ttft".
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:?usage: scripts/gpu_session.sh RESULTS_DIR [BASELINE_TREE]}
baseline=${2:-}
mkdir -p "$results"
limit=${STEP_TIMEOUT:-600}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$results/gpu.txt" 2>&1
git rev-parse HEAD > "$results/commit.txt" 2>/dev/null || true

step() {            # step NAME FILE COMMAND...: runs COMMAND, its stdout to FILE
    local name=$1 file=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    timeout "$limit" "$@" > "$results/$file" 2> "$results/$name.err"
    echo "$name rc=$? seconds=$((SECONDS - start))" >> "$results/steps.txt"
}

# 1. correctness on the GPU: the CUDA tests, then the equivalence and speculation suites
#    (logit processors and logprobs included) with CUDA as the test device
step cuda_tests cuda_tests.txt python -m pytest -q tests/test_cuda.py
#    the targets, kernels and drafters whose CUDA tests skip on the CPU (their Triton paths,
#    graphs and the overlap scheduler)
step cuda_new cuda_new.txt python -m pytest -q tests/test_hybrid_graphs.py \
    tests/test_recurrent_kernels.py tests/test_kv_fp8.py tests/test_fp8.py tests/test_gpt_oss.py \
    tests/test_glm4_moe.py tests/test_deepseek_v32.py tests/test_parallel_draft.py \
    tests/test_dflash.py tests/test_sliding_blocks.py tests/test_cuda_moe.py \
    tests/test_triton_kernels.py
step cuda_new_equivalence cuda_new_equivalence.txt env ONESPEC_TEST_DEVICE=cuda \
    python -m pytest -q tests/test_hybrid.py tests/test_attention_dp.py
step cuda_equivalence cuda_equivalence.txt env ONESPEC_TEST_DEVICE=cuda python -m pytest -q \
    tests/test_models.py tests/test_spec.py tests/test_mtp.py tests/test_logprobs.py \
    tests/test_logit_processors.py tests/test_structured.py

# 2. the redesign's A/B: the same decode rows on this tree and on the baseline, one session
ab=(--batch-sizes 1,32 --ks 0,3 --acceptance 3.0 --trials 3 --no-hf)
step ab_new ab_new.jsonl python bench/decode.py "${ab[@]}"
if [ -n "$baseline" ]; then
    step ab_baseline ab_baseline.jsonl env PYTHONPATH="$baseline" \
        python "$baseline/bench/decode.py" "${ab[@]}"
fi

# 3. the new targets' goals: the hybrid MTP shape, gpt-oss with EAGLE-3, FP8 beside bf16,
#    DeepSeek-V3.2's sparse attention at 4k and 64k (index sharing on and off)
new=(--batch-sizes 1,32 --ks 0,3 --acceptance 3.0 --trials 2 --no-hf)
step hybrid hybrid.jsonl python bench/decode.py --shape qwen3.5-moe-hybrid "${new[@]}"
step gpt_oss gpt_oss.jsonl python bench/decode.py --shape gpt-oss-20b "${new[@]}"
step fp8 fp8.jsonl python bench/decode.py --batch-sizes 1 --ks 0,3 --acceptance 3.0 --no-hf \
    --quantization fp8 --draft-dtype fp8
step bf16 bf16.jsonl python bench/decode.py --batch-sizes 1 --ks 0,3 --acceptance 3.0 --no-hf
step v2_lite_fp8 v2_lite_fp8.jsonl python bench/decode.py --shape deepseek-v2-lite \
    --quantization fp8-block --batch-sizes 1 --ks 0,3 --acceptance 3.0 --no-hf
for ctx in 4096 65536; do
    for share in --mtp-index-share --no-mtp-index-share; do
        step "dsa_${ctx}${share}" "dsa_${ctx}${share}.jsonl" python bench/decode.py \
            --shape deepseek-v3.2 --batch-sizes 1 --ks 0,3 --acceptance 3.0 --no-hf \
            --prompt-len "$ctx" --gen-len 64 --trials 2 "$share"
    done
done

# 4. the rows still missing on the H200 (long contexts, prefix TTFT, auto K, the demo)
long=(--batch-sizes 1,8,32 --ks 0,3 --acceptance 3.0 --trials 2 --gen-len 48 --no-hf)
step long_16k long_16k.jsonl python bench/decode.py --prompt-len 16384 "${long[@]}"
step prefix_ttft prefix_ttft.jsonl python bench/prefix_ttft.py --prompt-len 16384 \
    --cached-len 15360
step long_64k long_64k.jsonl python bench/decode.py --prompt-len 65536 --batch-sizes 1 \
    --ks 0,3 --acceptance 3.0 --trials 2 --gen-len 48 --no-hf
step auto_k auto_k.jsonl python bench/decode.py --batch-sizes 1,8,32,64 \
    --ks 0,1,2,3,4,5,auto --acceptance-rates 0.70,0.57,0.45,0.38,0.31 --gen-len 256 --no-hf
step demo demo.txt onespec demo
echo "done: $(wc -l < "$results/steps.txt") steps" >> "$results/steps.txt"
