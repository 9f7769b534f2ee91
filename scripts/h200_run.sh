#!/usr/bin/env bash
# Everything one H200 session checks, in one call (see .library/device notes in the README):
#   GPU kernel tests in fp32/bf16/fp16, then the phase notebooks through papermill at the
#   Qwen2.5-3B shape. Executed notebooks + JSON land in $OUT (tarred: the device returns at
#   most 8 files) and are committed to results/h200/.
# Usage on the device machine, from the repo root, with .wheels/ carried:
#   PAGESERVE_GIT_COMMIT=<sha> bash scripts/h200_run.sh [stage ...]   (stages: tests 01 02 03 04 05 06a)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD JUPYTER_PATH=/tmp/site/share/jupyter PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; RES=/tmp/pageserve_res/h200; mkdir -p "$RES" "$OUT"
export PAGESERVE_RESULTS_DIR=$RES
stages=${*:-tests 01 05 04 02 03 06a}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$RES/nvidia-smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

run_nb() {  # run_nb <name> [papermill -p args...]
  local name=$1; shift
  local t0=$(date +%s)
  papermill --no-progress-bar --cwd notebooks "notebooks/$name.ipynb" "$RES/$name.ipynb" \
    -p RESULTS_DIR "$RES" "$@" > "$RES/$name.log" 2>&1
  echo "notebook $name: rc=$? in $(( $(date +%s) - t0 )) s"; tail -n 5 "$RES/$name.log"
}
for s in $stages; do
  case $s in
    tests) python3 -m pytest -q -x tests/test_kernels.py 2>&1 | tail -n 25 | tee "$RES/gpu_tests.log" ;;
    01) run_nb 01_naive_generation -p MODEL qwen2.5-3b -p DEVICE cuda -p DTYPE bfloat16 -p PARITY_PROMPTS 8 -p PARITY_STEPS 64 -p PARITY_POSITIONS 2048 ;;
    05) run_nb 05_triton_kernels -p DEVICE cuda ;;
    04) run_nb 04_cuda_graphs -p MODEL qwen2.5-3b -p DEVICE cuda ;;
    02) run_nb 02_continuous_batching_paged_kv -p MODEL qwen2.5-3b -p DEVICE cuda -p DTYPE bfloat16 -p NUM_REQUESTS 500 -p PROMPT_LEN 512 -p OUTPUT_LEN 256 -p HF_NUM_REQUESTS 64 ;;
    03) run_nb 03_chunked_prefill -p MODEL qwen2.5-3b -p DEVICE cuda -p DTYPE bfloat16 ;;
    06a) run_nb 06a_prefix_caching -p MODEL qwen2.5-3b -p DEVICE cuda -p DTYPE bfloat16 ;;
  esac
done
tar -C /tmp/pageserve_res -czf "$OUT/h200_results.tgz" h200 && ls -la "$OUT" "$RES"
