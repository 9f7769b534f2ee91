#!/usr/bin/env bash
# Everything one H200 session checks, in one call: GPU tests (kernels in fp32/bf16/fp16,
# graph replay, sampler), then the phase notebooks through papermill at the Qwen2.5-3B
# shape. Executed notebooks + JSON are tarred into $OUT (the device returns at most 8 files)
# and committed to results/h200/. Each stage has its own time limit so one slow stage
# cannot cost the others their record.
# Usage on the device machine, from the repo root, with .wheels/ carried:
#   PAGESERVE_GIT_COMMIT=<sha> PAGESERVE_GIT_DIRTY=<0|1> bash scripts/h200_run.sh [stage:seconds ...]
# or, better, run scripts/stamp_commit.sh here first and carry .run_stamp (no sha typed by hand),
# with both computed here, where the repository is: `git rev-parse HEAD` and
# `git status --porcelain | grep -c .` (the copy on the device has no trustworthy .git).
# Stages: tests pytest splitnorm replayprobe structured spec beambench specoracle lora shrinkprobe cublasbits cublasband cublaslt tp2tests tpsmoke (2 GPUs) tunableop vllmcost dettests detbench detm1 planes detb1 detw1 argmaxab detattn invsweep profile_steps prefill_sweep prefillprobe gusprobe timeline overlap gemmfirst w1prof int8tests skinny 08serve 08tput w1defaults 01 02 03 04 05 06a 06b 06c 07 08 09 w1diag switches sweep_m1 decode_switches profile attn_sweep (no default: name every stage).
# Each call costs its wall time plus ~60 s (start, transfers, release); a 30-minute session fits
# about 1,400 s of stages. Seen on the H200: tests 115 s, 01 74, 02 129, 03 78, 04 128, 05 75,
# 06a 22, cublasbits ~50 (bf16 timings + fp16 bits), 06c (2 GPUs: run on nvidia-h200-x2; ~240 predicted, results to results/h200x2/), 07 (serving, 3 x 60 s of arrivals) ~330 predicted, switches ~60, sweep_m1 ~70, decode_switches ~60, profile ~40, attn_sweep ~30, 09 (real weights) 264 s on a machine
# that had compiled its kernels and > 330 s on a cold Triton cache (give it 480), dettests ~200 warm but > 230 cold in one process, 77 s cold under pytest-xdist (session 13; give 150), tests 40-60 s under xdist warm, 103 s for 382 tests at 05e6ae9 and > 170 s on a cold cache (give it 250; > 150 cold without xdist; at cbbf3ae, ~500 tests after a structured + w1defaults call, 210 s reached only 87%: give it 330), int8tests ~50 s under xdist, 06b ~80-110 s, 08tput ~210 s (245 s at 4ad65be), detm1 ~27, argmaxab ~40-60 s (session 14; with 256 rows ~75 s), w1prof nano-vllm ~60 s and chat ~45 s with --no-cprofile, 09 387 s and 06b 142 s after 08tput (session 15). E.g.
#   04:180 05:110 tests:170      then      switches:120 decode_switches:150 01:100 02:180
set -uo pipefail
# no default stages: a call that forgot them ran tests + 04 + 02 + 01 and lost ~500 s of device time (session 30)
[ $# -gt 0 ] || { echo "usage: bash scripts/h200_run.sh stage:seconds [stage:seconds ...] (no default stages)" >&2; exit 2; }
# no --upgrade: packages already in /tmp/site (vLLM's pinned pydantic/fastapi from .vllm3/install.sh) stay as they are
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl 2>&1 | grep -v 'already exists' || true
export PYTHONPATH=/tmp/site:$PWD JUPYTER_PATH=/tmp/site/share/jupyter PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; RES=/tmp/pageserve_res/h200; mkdir -p "$RES/diagnostics" "$OUT"
export PAGESERVE_RESULTS_DIR=$RES
stages=$*
# the commit from .run_stamp (scripts/stamp_commit.sh, run where the repository is, carried) unless given
if [ -z "${PAGESERVE_GIT_COMMIT:-}" ] && [ -f .run_stamp ]; then
  read -r PAGESERVE_GIT_COMMIT n_changed < .run_stamp
  export PAGESERVE_GIT_COMMIT PAGESERVE_GIT_DIRTY=$(( n_changed > 0 ))
fi
echo "git commit ${PAGESERVE_GIT_COMMIT:-unknown} dirty ${PAGESERVE_GIT_DIRTY:-unknown}"
env | grep "^PAGESERVE_DET_" || true  # the switches a run was under (DeterministicOps.mixed_graphs)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$RES/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

# pytest-xdist, when carried in .wheels (`pip download --no-deps -d .wheels pytest-xdist execnet`): the
# GPU test stages compile their Triton kernels in 4 processes (16 cores) instead of one; a cold
# cache made dettests > 230 s in one process (0ea6d46). Without it the stages run as before.
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n ${PYTEST_WORKERS:-4}"
echo "pytest workers: ${XDIST:-one process}"

install_vllm() {  # install_vllm <stage>: vLLM into /tmp/site from the pieces in /tmp/acc, once per machine
    [ -d /tmp/site/vllm ] || (cd /tmp/acc && if [ -f install.sh ]; then bash install.sh; else bash .vllm3/install.sh; fi) \
      || echo "$1: vLLM install failed; running without it"  # install.sh: scripts/vllm_resplit.sh's pieces
}

run_nb() {  # run_nb <seconds> <name> [papermill -p args...]
  local limit=$1 name=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 -m papermill --no-progress-bar --cwd notebooks "notebooks/$name.ipynb" "$RES/$name.ipynb" \
    -p RESULTS_DIR "$RES" "$@" > "$RES/$name.log" 2>&1
  echo "notebook $name: rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "Error|error" "$RES/$name.log" | tail -n 5
}
Q3B="-p MODEL qwen2.5-3b -p DEVICE cuda"
for st in $stages; do
  s=${st%%:*}; t=${st##*:}
  case $s in
    tests) { echo "git commit ${PAGESERVE_GIT_COMMIT:-unknown} dirty ${PAGESERVE_GIT_DIRTY:-unknown}"  # the log names its commit
             # -v: each result is named as it lands, so a run cut by its time limit still names its failures
            timeout "$t" python3 -m pytest -v -rA -p no:cacheprovider $XDIST --junitxml "$RES/gpu_tests.xml" tests/test_kernels.py \
             tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_sampler.py tests/test_candidate_race.py tests/test_penalties.py tests/test_topk_select.py \
             tests/test_lora.py::test_on_the_gpu_graphed_mixed_batches_apply_each_rows_adapter; } > "$RES/gpu_tests.log" 2>&1
           echo "tests rc=$? ($(grep -cE "^(PASSED|FAILED|ERROR|SKIPPED) " "$RES/gpu_tests.log") named results in gpu_tests.log/.xml)"; tail -n 15 "$RES/gpu_tests.log"
           grep -E "(FAILED|ERROR) tests/" "$RES/gpu_tests.log" | head -n 10 ;;
    skinny) timeout "$t" python3 -m pageserve.lab.kernel_bench --out "$RES/diagnostics" --parts "${SKINNY_PARTS:-gemv,gemv_int8}" --skip-checks \
              --gemv-batches "${SKINNY_MS:-16,64}" --json kernels_skinny.json > "$RES/skinny.log" 2>&1
            echo "skinny rc=$?"; grep -E "stack|error" "$RES/skinny.log" | tail -n 12 ;;
    cublasband) # cuBLAS at each 3B linear over decode row counts, beside the GEMV kernel's heuristic tile (CUBLAS_BAND_MS)
              timeout "$t" python3 -m pageserve.lab.kernel_bench --out "$RES/diagnostics" --parts gemv --skip-checks --no-tune \
                --gemv-batches "${CUBLAS_BAND_MS:-64,128,136,160,192,200,224,256,384,512}" --json kernels_cublas_band.json \
                > "$RES/cublas_band.log" 2>&1
              echo "cublasband rc=$?"; grep -E "stack" "$RES/cublas_band.log" | tail -n 12 ;;
    cublaslt) # cuBLASLt's heuristic algorithms vs torch's pick per 3B linear (scripts/cublaslt_probe.py); needs
              # nvmath-python and its CUDA bindings carried in .nvm/ (pip download --no-deps nvmath-python cuda-bindings
              # cuda-core cuda-pathfinder, cp312 manylinux wheels)
              [ -d .nvm ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .nvm/*.whl 2>&1 | grep -v 'already exists'
              timeout "$t" python3 scripts/cublaslt_probe.py --out "$RES/diagnostics" --ms "${CUBLASLT_MS:-160,200,128,256,64}" \
                > "$RES/cublaslt_probe.log" 2>&1; echo "cublaslt rc=$?"; tail -n 30 "$RES/cublaslt_probe.log" ;;
    switches) timeout "$t" python3 -m pageserve.lab.kernel_bench --out "$RES" --parts switches --skip-checks \
                > "$RES/switches.log" 2>&1; echo "switches rc=$?"; tail -n 25 "$RES/switches.log" ;;
    sweep_m1) timeout "$t" python3 -m pageserve.lab.kernel_bench --out "$RES" --parts sweep_m1 --skip-checks \
                --json kernels_sweep_m1.json > "$RES/sweep_m1.log" 2>&1; echo "sweep_m1 rc=$?"; tail -n 12 "$RES/sweep_m1.log" ;;
    decode_switches) timeout "$t" python3 scripts/decode_switches.py --out "$RES" ${DECODE_SWITCHES_ARGS:-} \
                > "$RES/decode_switches.log" 2>&1
                echo "decode_switches rc=$?"; tail -n 25 "$RES/decode_switches.log" ;;
    attn_sweep) timeout "$t" python3 scripts/decode_attn_sweep.py --out "$RES" ${ATTN_SWEEP_ARGS:-} > "$RES/decode_attn_sweep.log" 2>&1
                echo "attn_sweep rc=$?"; tail -n 25 "$RES/decode_attn_sweep.log" ;;
    prefill_sweep) timeout "$t" python3 scripts/prefill_attn_sweep.py --out "$RES/diagnostics" ${PREFILL_SWEEP_ARGS:-} \
                     > "$RES/prefill_attn_sweep.log" 2>&1; echo "prefill_sweep rc=$?"; tail -n 16 "$RES/prefill_attn_sweep.log" ;;
    prefillprobe) timeout "$t" python3 scripts/prefill_attn_probe.py --out "$RES/diagnostics" ${PREFILL_PROBE_ARGS:-} \
                    > "$RES/prefill_attn_probe.log" 2>&1; echo "prefillprobe rc=$?"; tail -n 30 "$RES/prefill_attn_probe.log" ;;
    gusprobe) timeout "$t" python3 scripts/gate_up_silu_probe.py --out "$RES/diagnostics" ${GUS_PROBE_ARGS:-} \
                > "$RES/gate_up_silu_probe.log" 2>&1; echo "gusprobe rc=$?"; tail -n 45 "$RES/gate_up_silu_probe.log" ;;
    gemmfirst) timeout "$t" python3 scripts/gemm_first_call.py --out "$RES/diagnostics" ${GEMM_FIRST_ARGS:-} \
                 > "$RES/gemm_first_call.log" 2>&1; echo "gemmfirst rc=$?"; tail -n 30 "$RES/gemm_first_call.log" ;;
    tunableop) timeout "$t" python3 scripts/tunableop_probe.py --out "$RES/diagnostics" ${TUNABLEOP_ARGS:-} \
                 > "$RES/tunableop_probe.log" 2>&1; echo "tunableop rc=$?"; tail -n 20 "$RES/tunableop_probe.log" ;;
    w1prof) timeout "$t" python3 scripts/w1_profile.py --out "$RES/diagnostics" ${W1PROF_ARGS:-} > "$RES/w1_profile.log" 2>&1
            echo "w1prof rc=$?"; head -n 60 "$RES/w1_profile.log" ;;
    overlap) # two half-batches on two streams vs the step on one (scripts/overlap_probe.py; OVERLAP_ARGS: --cases, --variants)
             timeout "$t" python3 scripts/overlap_probe.py --out "$RES/diagnostics" ${OVERLAP_ARGS:-} > "$RES/overlap_probe.log" 2>&1
             echo "overlap rc=$?"; tail -n 8 "$RES/overlap_probe.log" ;;
    replayprobe) # does what runs between two decode graph replays change the next one's time (scripts/replay_after_probe.py)
        timeout "$t" python3 scripts/replay_after_probe.py --out "$RES/diagnostics" ${REPLAY_PROBE_ARGS:-} > "$RES/replay_after_probe.log" 2>&1
        echo "replayprobe rc=$?"; grep -E "^b[0-9]|Error" "$RES/replay_after_probe.log" | tail -n 40 ;;
    splitnorm) # o / down as K slices summed by the next norm vs cuBLAS + the norm (scripts/split_norm_probe.py; SPLIT_NORM_ARGS)
        timeout "$t" python3 scripts/split_norm_probe.py --out "$RES/diagnostics" ${SPLIT_NORM_ARGS:-} > "$RES/split_norm_probe.log" 2>&1
        echo "splitnorm rc=$?"; tail -n 12 "$RES/split_norm_probe.log" ;;
    timeline) timeout "$t" python3 scripts/step_timeline.py --out "$RES/diagnostics" ${TIMELINE_ARGS:-} > "$RES/step_timeline.log" 2>&1
              echo "timeline rc=$?"; tail -n 8 "$RES/step_timeline.log" ;;
    int8tests) # the real-model accuracy test needs the carried GGUF (no package index here to fetch it)
               noreal=(-k "not real_default_model")
               [ -f /tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf ] && export PAGESERVE_TEST_MODEL=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf && noreal=()
               timeout "$t" python3 -m pytest -q -rA -p no:cacheprovider $XDIST "${noreal[@]}" --junitxml "$RES/gpu_int8_tests.xml" tests/test_int8.py \
                 > "$RES/gpu_int8_tests.log" 2>&1; echo "int8tests rc=$?"; tail -n 5 "$RES/gpu_int8_tests.log" ;;
    profile) timeout "$t" python3 scripts/profile_decode.py --out "$RES" > "$RES/profile_decode.log" 2>&1
                echo "profile rc=$?"; tail -n 70 "$RES/profile_decode.log" ;;
    01) run_nb "$t" 01_naive_generation $Q3B -p DTYPE bfloat16 -p PARITY_PROMPTS 8 -p PARITY_STEPS 64 -y "REAL_BF16_MODEL: null" \
          -p PARITY_PROMPT_LEN 256 -p PARITY_POSITIONS 2048 ;;
    02) run_nb "$t" 02_continuous_batching_paged_kv $Q3B -p DTYPE bfloat16 -p NUM_REQUESTS 500 -p PROMPT_LEN 512 \
          -p OUTPUT_LEN 256 -p HF_NUM_REQUESTS 64 -p MAX_NUM_SEQS 512 ;;
    03) run_nb "$t" 03_chunked_prefill $Q3B -p DTYPE bfloat16 -p NUM_SHORT 32 -p SHORT_PROMPT_LEN 128 \
          -p SHORT_OUTPUT_LEN 256 -p NUM_LONG 16 -p LONG_PROMPT_LEN 8192 -p LONG_OUTPUT_LEN 8 -p LONG_FIRST_STEP 8 \
          -p LONG_EVERY_STEPS 16 -p CHUNK_BUDGETS "256,512,1024,2048,4096,8192" -p NUM_BLOCKS 16384 ;;
    04) run_nb "$t" 04_cuda_graphs $Q3B -p NUM_SEQS 64 -p MIN_OUTPUT 256 -p MAX_OUTPUT 320 -p CHECK_BF16 True \
          -p TIMING_BATCHES "1,2,4,8,64" -p TIMING_CONTEXT 512 -p TIMING_STEPS 32 -p W1_NUM_REQUESTS 500 \
          -p MIXED_DECODES 128 -p MIXED_PREFILL_TOKENS 512 -p CHAT_NUM_REQUESTS 1000 -p CHAT_MAX_LEN 4096 ;;
    06b) realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf  # the accuracy part's real weights, as 07
         [ -f "$realw" ] || { echo "06b: no carried real weights: the accuracy part is skipped"; realw=/tmp/realw/not-carried.gguf; }
         run_nb "$t" 06b_int8_quantization $Q3B -p REAL_MODEL "$realw" -p REAL_DTYPE bfloat16 -p TIMING_BATCHES "1,2,4,8,64" \
           -p TIMING_CONTEXT 512 -p TIMING_STEPS 32 -p W1_NUM_REQUESTS 500 -p MAX_NUM_SEQS 512 -p MAX_MODEL_LEN 2048 \
           -p TUNE_INT8 True -p KERNEL_BENCH True -p PREFILL_MS "16,32,64,128,256,512,2048" ;;
    07) realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf  # the default model's real weights (model-pack.sh)
        [ -f "$realw" ] || { echo "07: $realw missing: carry .realw1/.realw2 first"; realw=smollm2-135m-instruct; }
        run_nb "$t" 07_openai_server -p CHAT_MODEL "$realw" -p MODEL qwen2.5-3b -p DEVICE cuda -y "NUM_BLOCKS: null" \
          -p CHAT_NUM_BLOCKS 4096 -p LOAD_STREAMS 64 -p LOAD_MAX_TOKENS 128 -p WARMUP_REQUESTS 16 -y "RATES: [4, 16, 32]" \
          -p RATE_DURATION_S "${RATE_DURATION_07:-60}" -p RATE_PROMPT_LEN 512 -p RATE_OUTPUT_LEN 256 -p FP16_CHECK True -p FP16_RATE 4 ;;
    08) # vLLM 0.26 from the vllm-pack.sh pieces in /tmp/acc (.vllm1/.vllm2/.vllm3 carried);
        # 518 s at 3eef1891 (one process per engine); now two per engine for pageserve and vLLM (prefix
        # caching off / on) and per-workload warm-ups, so HF on 32 W1 requests and 12 s per rate: predicted
        # ~560 s. Run it alone (08:585); if it times out, drop hf_generate from ENGINES.
        install_vllm 08
        [ -d .vllmx ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .vllmx/*.whl  # scripts/vllm_extra_wheels.sh
        VLLM_USE_FLASHINFER_SAMPLER=0 run_nb "$t" 08_benchmarks $Q3B -p DTYPE bfloat16 \
          -y 'ENGINES: [pageserve, vllm, hf_generate_batch, hf_generate]' -y 'SERVE_ENGINES: [pageserve, vllm]' \
          -y 'WORKLOADS: {w1: {}, nanovllm: {}, chat: {}, shared_prefix: {}}' -p HF_W1_NUM_REQUESTS 32 \
          -p HF_GENERATE_BATCH_SIZE 32 -y 'PAGESERVE_ARGS: {}' -y 'CACHED_WORKLOADS: [shared_prefix]' \
          -y 'VLLM_ARGS: {gpu_memory_utilization: 0.85, max_model_len: 4096}' \
          -y 'DECODE: {batches: [1, 64], context_len: 512, steps: 64, repeats: 3}' -y 'RATES: [4, 8, 16, 32]' \
          -p RATE_DURATION_S 12 -p RATE_PROMPT_LEN 512 -p RATE_OUTPUT_LEN 256 -p WARMUP_REQUESTS 16 -y 'SERVE_ARGS: {}' ;;
    09) realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf  # the default model's real weights (model-pack.sh)
        [ -f "$realw" ] || { echo "09: $realw missing: carry .realw1/.realw2 first"; realw=smollm2-135m-instruct; }
        run_nb "$t" 09_deterministic -p CHAT_MODEL "$realw" -p DTYPE bfloat16 -p NUM_PROMPTS 16 -p MAX_TOKENS 64 \
          -p NUM_BLOCKS 4096 -p SHAPE_MODEL qwen2.5-3b -p BATCH_OTHERS 63 -p LOGIT_TOKENS 16 -p PROBE_LEN 512 \
          -p W1_NUM_REQUESTS 500 -y "TIMING_BATCHES: [1, 64]" -p TIMING_CONTEXT 512 -p TIMING_STEPS 32 \
          -p MAX_NUM_SEQS 512 -y "SHAPE_NUM_BLOCKS: null" -p MAX_MODEL_LEN 2048 \
          -p VLLM_COST "$([ -d /tmp/site/vllm ] && [ -z "${NO_VLLM_COST09:-}" ] && echo True || echo False)" ;;  # vLLM's cost too where carried (+~200 s; NO_VLLM_COST09=1 skips it)
    structured) # what structured outputs cost (scripts/structured_bench.py): the 3B shape lent the real weights' tokenizer,
                # then the real 135M model (host cost against a ~2 ms step); needs the realw carries (no tokenizer offline)
        realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf
        [ -f "$realw" ] || { echo "structured: $realw missing: carry .realw1/.realw2 first"; continue; }
        for m in qwen2.5-3b "$realw"; do
          timeout "$(( t / 2 ))" python3 scripts/structured_bench.py --out "$RES/diagnostics/structured_$(basename "$m" .gguf)" \
            --model "$m" --tokenizer-from "$realw" --device cuda --dtype bfloat16 ${STRUCTURED_ARGS:-} >> "$RES/structured_bench.log" 2>&1
          echo "structured $m rc=$?"; tail -n 1 "$RES/structured_bench.log"
        done ;;
    spec) # n-gram speculative decoding (scripts/spec_bench.py) on the real 135M model, bf16: needs the realw carries
        realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf
        [ -f "$realw" ] || { echo "spec: $realw missing: carry .realw1/.realw2 first"; continue; }
        timeout "$t" python3 scripts/spec_bench.py --out "$RES/diagnostics/spec_bench" --model "$realw" --device cuda \
          --dtype bfloat16 ${SPEC_BENCH_ARGS:-} > "$RES/spec_bench.log" 2>&1
        echo "spec rc=$?"; grep -E "_speedup|_acceptance|_equal|Error" "$RES/spec_bench.log" | tail -n 30 ;;
    beambench) # beam search against transformers' num_beams (scripts/beam_bench.py) on the real 135M model, bf16
        realw=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf
        [ -f "$realw" ] || { echo "beambench: $realw missing: carry .realw1/.realw2 first"; continue; }
        timeout "$t" python3 scripts/beam_bench.py --out "$RES/diagnostics/beam_bench" --model "$realw" --device cuda \
          --dtype bfloat16 ${BEAM_BENCH_ARGS:-} > "$RES/beam_bench.log" 2>&1
        echo "beambench rc=$?"; tail -n 3 "$RES/beam_bench.log" ;;
    samplingbench) # what the sampling a user gets by default costs at the 3B shape (scripts/sampling_bench.py): greedy,
                   # penalised, sampled, Qwen2.5-Instruct's defaults, seeded; allocator counters and sampler op profiles
                   # SAMPLING_BENCH_TAG names a second run in the same call (e.g. _b1 with --requests 1)
        sb=sampling_bench${SAMPLING_BENCH_TAG:-}
        timeout "$t" python3 scripts/sampling_bench.py --out "$RES/diagnostics/$sb" --model qwen2.5-3b --device cuda \
          --dtype bfloat16 ${SAMPLING_BENCH_ARGS:-} > "$RES/$sb.log" 2>&1
        echo "samplingbench${SAMPLING_BENCH_TAG:-} rc=$?"; grep -v USDT "$RES/$sb.log" | tail -n 1 | cut -c1-1500 ;;
    specoracle) # the verify step's cost at the 3B shape (random weights): drafts from the plain run, all accepted
                # (the deterministic mode: in the default one a near-tie flips at once; session 47)
        timeout "$t" python3 scripts/spec_bench.py --out "$RES/diagnostics/spec_oracle" --model qwen2.5-3b --device cuda \
          --dtype bfloat16 --oracle ${SPEC_ORACLE_ARGS:---deterministic --batches 1,4,16,64 --ks 2,4 --rounds 2} > "$RES/spec_oracle.log" 2>&1
        echo "specoracle rc=$?"; grep -E "_speedup|_tokens_per_step|_equal|Error" "$RES/spec_oracle.log" | tail -n 40 ;;
    lora) # LoRA adapters at the 3B shape (scripts/lora_bench.py): adapter rows vs merged weights in a graphed mixed
        # batch, and the decode step's cost with LoRA on (no adapter / one / max_loras in turn) against plain
        timeout "$t" python3 scripts/lora_bench.py --out "$RES/diagnostics/lora" ${LORA_BENCH_ARGS:-} > "$RES/lora_bench.log" 2>&1
        echo "lora rc=$?"; tail -n 20 "$RES/lora_bench.log" ;;
    shrinkprobe) # LoRA's shrink kernel per 3B projection and config against the reference (scripts/lora_shrink_probe.py)
        timeout "$t" python3 scripts/lora_shrink_probe.py --out "$RES/diagnostics/lora" ${SHRINK_PROBE_ARGS:-} > "$RES/lora_shrink_probe.log" 2>&1
        echo "shrinkprobe rc=$?"; tail -n 16 "$RES/lora_shrink_probe.log" ;;
    vllmprof) # vLLM's decode step kernel by kernel (scripts/vllm_step_profile.py; VLLM_PROF_ARGS: --batches, --context)
        install_vllm vllmprof
        VLLM_USE_FLASHINFER_SAMPLER=0 timeout "$t" python3 scripts/vllm_step_profile.py --out "$RES/diagnostics" ${VLLM_PROF_ARGS:-} \
          > "$RES/vllm_step_profile.log" 2>&1; echo "vllmprof rc=$?"; grep -v -E "^(INFO|WARNING|DEBUG)" "$RES/vllm_step_profile.log" | tail -n 40 ;;
    vllmcost) timeout "$t" python3 scripts/vllm_cost.py --out "$RES/diagnostics" ${VLLM_COST_ARGS:-} > "$RES/vllm_cost.log" 2>&1
              echo "vllmcost rc=$?"; grep -E "Error|error|vllm_" "$RES/vllm_cost.log" | tail -n 20 ;;
    invsweep) timeout "$t" python3 scripts/invariant_sweep.py --out "$RES/diagnostics" --ms "${INV_SWEEP_MS:-1,16,64,128,256,512,1024,4096,8192}" ${INV_SWEEP_SHAPES:+--shapes "$INV_SWEEP_SHAPES"} ${INV_SWEEP_ARGS:-} \
                > "$RES/invariant_sweep.log" 2>&1; echo "invsweep rc=$?"; tail -n 45 "$RES/invariant_sweep.log" ;;
    detattn) timeout "$t" python3 scripts/det_attn_sweep.py --out "$RES/diagnostics" ${DET_ATTN_ARGS:-} > "$RES/det_attn_sweep.log" 2>&1
             echo "detattn rc=$?"; tail -n 12 "$RES/det_attn_sweep.log" ;;
    cublasbits) # cuBLAS's rows bitwise equal to the invariant matmul's, per linear and row count (CUBLAS_BITS_ARGS)
                timeout "$t" python3 scripts/cublas_bits_probe.py --out "$RES/diagnostics" ${CUBLAS_BITS_ARGS:-} \
                  > "$RES/cublas_bits_probe.log" 2>&1; echo "cublasbits rc=$?"; tail -n 20 "$RES/cublas_bits_probe.log" ;;
    detb1) timeout "$t" python3 scripts/det_b1_switches.py --out "$RES/diagnostics" ${DET_B1_ARGS:-} > "$RES/det_b1_switches.log" 2>&1
           echo "detb1 rc=$?"; tail -n 12 "$RES/det_b1_switches.log" ;;
    detw1) # detb1's engines sized as notebook 09's, with W1 per variant (DET_W1_ARGS: --variants, --w1 N, --batches)
           timeout "$t" python3 scripts/det_b1_switches.py --out "$RES/diagnostics" --name det_w1_switches --w1 500 \
             ${DET_W1_ARGS:-} > "$RES/det_w1_switches.log" 2>&1
           echo "detw1 rc=$?"; tail -n 12 "$RES/det_w1_switches.log" ;;
    argmaxab) timeout "$t" python3 scripts/argmax_ab.py --out "$RES/diagnostics" ${ARGMAX_AB_ARGS:-} > "$RES/argmax_ab.log" 2>&1
              echo "argmaxab rc=$?"; tail -n 10 "$RES/argmax_ab.log" ;;
    planes) timeout "$t" python3 scripts/int8_planes_bench.py --out "$RES/diagnostics" ${PLANES_ARGS:-} > "$RES/int8_planes_bench.log" 2>&1
            echo "planes rc=$?"; grep -E "^stack|Error" "$RES/int8_planes_bench.log" | tail -n 12 ;;
    detm1) timeout "$t" python3 scripts/det_m1_bench.py --out "$RES/diagnostics" ${DET_M1_ARGS:-} > "$RES/det_m1_bench.log" 2>&1
           echo "detm1 rc=$?"; tail -n 12 "$RES/det_m1_bench.log" ;;
    detbench) timeout "$t" python3 scripts/det_bench.py --out "$RES" --ms "${DET_BENCH_MS:-1,64,4096}" ${DET_BENCH_ARGS:-} > "$RES/det_bench.log" 2>&1
              echo "detbench rc=$?"; tail -n 30 "$RES/det_bench.log" ;;
    profile_steps) timeout "$t" python3 scripts/profile_steps.py --out "$RES/diagnostics" ${PROFILE_STEPS_ARGS:-} \
                     > "$RES/profile_steps.log" 2>&1; echo "profile_steps rc=$?"; tail -n 60 "$RES/profile_steps.log" ;;
    08serve) # the serving sweep alone (results/h200/08_serving.*): pageserve serve and vllm serve over HTTP.
        # An A/B of a pageserve option: SERVE08_ENGINES='[pageserve]' SERVE08_ARGS='{mixed_cuda_graphs: false}'
        # SERVE08_RECORD=08_serving_eager_mixed (the record's name; its files are named after it)
        # With vLLM give it ~450 s alone: at 5c810d1 (after 08tput) 250 s ended inside vLLM's first rate
        # (pageserve's half ~100 s; vllm serve's start-up and four rates the rest)
        [ -d /tmp/site/vllm ] || echo "08serve: no vLLM in /tmp/site (carry .vllm1-3 first): pageserve only"
        [ -d .vllmx ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .vllmx/*.whl
        rec=${SERVE08_RECORD:-08_serving}
        VLLM_USE_FLASHINFER_SAMPLER=0 run_nb "$t" 08_benchmarks $Q3B -p DTYPE bfloat16 -p RECORD_NAME "$rec" \
          -y 'ENGINES: []' -y "SERVE_ENGINES: ${SERVE08_ENGINES:-[pageserve, vllm]}" -y 'RATES: [4, 8, 16, 32]' \
          -p RATE_DURATION_S "${RATE_DURATION_08:-15}" -p RATE_PROMPT_LEN 512 -p RATE_OUTPUT_LEN 256 -p WARMUP_REQUESTS 16 \
          -y "SERVE_ARGS: ${SERVE08_ARGS:-{\}}"
        mv "$RES/08_benchmarks.ipynb" "$RES/$rec.ipynb"; mv "$RES/08_benchmarks.log" "$RES/$rec.log" ;;
    08tput) # issue 14's comparison alone (results/h200/08_throughput.*): pageserve and vLLM offline, defaults on
        # both sides (pageserve's max_num_seqs sized from its pool), W1 / nano-vllm / chat, decode b1/b64; no HF, no serving.
        # One engine, another record name: TPUT08_ENGINES='[vllm]' TPUT08_RECORD=08_throughput_vllm_cold
        # Decode steps only, at other batches (nano-vllm's 129-256-row band): TPUT08_WORKLOADS='{}'
        # TPUT08_DECODE='{batches: [64, 128, 200, 256], context_len: 512, steps: 64, repeats: 3}' TPUT08_RECORD=08_decode_band
        install_vllm 08tput
        VLLM_USE_FLASHINFER_SAMPLER=0 run_nb "$t" 08_benchmarks $Q3B -p DTYPE bfloat16 -p RECORD_NAME "${TPUT08_RECORD:-08_throughput}" \
          -y "ENGINES: ${TPUT08_ENGINES:-[pageserve, vllm]}" -y 'SERVE_ENGINES: []' -y "WORKLOADS: ${TPUT08_WORKLOADS:-{w1: {\}, nanovllm: {\}, chat: {\}\}}" \
          -y 'PAGESERVE_ARGS: {}' -y 'CACHED_WORKLOADS: []' -y 'VLLM_ARGS: {gpu_memory_utilization: 0.85, max_model_len: 4096}' \
          -y "DECODE: ${TPUT08_DECODE:-{batches: [1, 64], context_len: 512, steps: 64, repeats: 3\}}" -p WARMUP_REQUESTS 16 \
          -p PASSES "${TPUT08_PASSES:-3}"  # three timed passes a workload in each engine, the median the figure (+~100 s)
        rec=${TPUT08_RECORD:-08_throughput}
        mv "$RES/08_benchmarks.ipynb" "$RES/$rec.ipynb"; mv "$RES/08_benchmarks.log" "$RES/$rec.log" ;;
    w1defaults) timeout "$t" python3 scripts/w1_defaults.py --out "$RES/diagnostics" ${W1_DEFAULTS_ARGS:-} > "$RES/w1_defaults.log" 2>&1
                echo "w1defaults rc=$?"; tail -n 8 "$RES/w1_defaults.log" ;;
    w1diag) timeout "$t" python3 scripts/w1_diag.py --out "$RES" > "$RES/w1_diag.log" 2>&1; echo "w1diag rc=$?"; tail -n 8 "$RES/w1_diag.log" ;;
    pytest) # any test files on the GPU (PYTEST_FILES, default the sampler's), log in diagnostics/; the real-weights
            # tests read the carried GGUF when there is one (no package index on the GPU machine)
             [ -f /tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf ] && export PAGESERVE_TEST_MODEL=/tmp/realw/SmolLM2-135M-Instruct.Q4_1.gguf
             { echo "git commit ${PAGESERVE_GIT_COMMIT:-unknown} dirty ${PAGESERVE_GIT_DIRTY:-unknown}"  # as tests' log
               timeout "$t" python3 -m pytest -v -rfE -n 4 -p no:cacheprovider ${PYTEST_FILES:-tests/test_sampler.py}; } \
               > "$RES/diagnostics/gpu_pytest.log" 2>&1; echo "pytest rc=$?"; grep -E "FAILED|ERROR" "$RES/diagnostics/gpu_pytest.log" | head -n 20; tail -n 3 "$RES/diagnostics/gpu_pytest.log" ;;
    dettests) { echo "git commit ${PAGESERVE_GIT_COMMIT:-unknown} dirty ${PAGESERVE_GIT_DIRTY:-unknown}"  # as tests' log
             timeout "$t" python3 -m pytest -q -rA -p no:cacheprovider $XDIST --junitxml "$RES/gpu_det_tests.xml" \
             tests/test_matmul_invariant.py tests/test_attention_invariant.py tests/test_deterministic.py -s; } \
             > "$RES/gpu_det_tests.log" 2>&1
           echo "dettests rc=$?"; tail -n 25 "$RES/gpu_det_tests.log" ;;
    05) run_nb "$t" 05_triton_kernels -p TUNE_GEMV False ;;  # the engine's configs (shipped tuned ones, else the heuristic)
    tp2tests) RES2=/tmp/pageserve_res/h200x2; mkdir -p "$RES2"  # 2 GPUs: the one-shot all-reduce against the rank-ordered sum
              timeout -s ABRT "$t" python3 -X faulthandler -m pytest -q -rA -p no:cacheprovider --junitxml "$RES2/gpu_tp2_tests.xml" tests/test_custom_allreduce.py \
                > "$RES2/gpu_tp2_tests.log" 2>&1
              rc=$?; echo "tp2tests rc=$rc"; tail -n 15 "$RES2/gpu_tp2_tests.log"
              # a one-shot all-reduce that fails its check must not run the engine's collectives
              [ "$rc" = 0 ] || { export PAGESERVE_CUSTOM_ALL_REDUCE=0; echo "tp2tests failed: custom all-reduce off for the stages after it"; }
              tar -C /tmp/pageserve_res -czf "$OUT/h200x2_results.tgz" h200x2 ;;
    tpsmoke) RES2=/tmp/pageserve_res/h200x2; mkdir -p "$RES2"  # 2 GPUs: TP=1 vs 2 through the engine, small shape
             timeout -s ABRT "$t" python3 -X faulthandler scripts/tp_gpu_smoke.py > "$RES2/tp_gpu_smoke.log" 2>&1; echo "tpsmoke rc=$?"; tail -n 12 "$RES2/tp_gpu_smoke.log"
             tar -C /tmp/pageserve_res -czf "$OUT/h200x2_results.tgz" h200x2 ;;
    06c) RES2=/tmp/pageserve_res/h200x2; mkdir -p "$RES2"  # 2 GPUs: results/h200x2/, not results/h200/
         RES=$RES2 PAGESERVE_RESULTS_DIR=$RES2 run_nb "$t" 06c_tensor_parallel -p MODEL qwen2.5-3b -y "NUM_LAYERS: null" \
           -p DEVICE cuda -p TP 2 -p NUM_PROMPTS 16 -p PROMPT_LEN 128 -p GREEDY_TOKENS 64 -p LOGIT_PROMPTS 4 \
           -p BATCH1_PROMPT_LEN 512 -p BATCH1_OUTPUT_LEN 128 -p W1_NUM_REQUESTS 500 -p W1_PROMPT_LEN 512 \
           -p W1_OUTPUT_LEN 256 -p MAX_NUM_SEQS 512 -y "NUM_BLOCKS: null" -p ALLREDUCE_ITERS 480 -y "ALLREDUCE_ROWS: [1, 8, 64, 512, 2048]"
         tar -C /tmp/pageserve_res -czf "$OUT/h200x2_results.tgz" h200x2 ;;
    06a) run_nb "$t" 06a_prefix_caching $Q3B -p DTYPE bfloat16 -p NUM_REQUESTS 128 -p SYSTEM_PROMPT_LEN 1024 \
          -p QUESTION_LEN 64 -p OUTPUT_LEN 64 -p NUM_SYSTEM_PROMPTS 4 -p MAX_NUM_BATCHED_TOKENS 8192 ;;
  esac
  tar -C /tmp/pageserve_res -czf "$OUT/h200_results.tgz" h200  # after every stage: a timeout keeps what ran
done
ls -la "$OUT" "$RES"
