#!/bin/bash
# What a GPU session of the device machine runs (docs/performance.md, "GPU"): correctness first, then speed, each
# step bounded so that the whole fits one call. Run from the repository root; $OUT is where logs go.
#   one-time, on this machine: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform any -d .whl transformers==5.24.0 gguf wonderwords pypdf \
#       platformdirs starlette uvicorn pydantic pydantic_core annotated-types typing-inspection fpdf2 defusedxml \
#       pyte wcwidth openai distro jiter sniffio rouge typer==0.29.2 rich==15.0.0 httpx2 httpcore2 truststore
#   (the image's own typer is older than the pin: help renders differently and `gali serve --host` is unknown)
#   then: run `bash benchmarks/gpu_session.sh` there with .whl carried.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gali-gpu}; mkdir -p "$OUT"
S=$(date +%s)
DEADLINE=${DEADLINE:-540}  # seconds: no step runs past it
step() { echo; echo "=== +$(( $(date +%s) - S ))s: $*"; }
cap() { local left=$(( DEADLINE - ($(date +%s) - S) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "pip failed"; tail -5 "$OUT/pip.log"; }
  # bitsandbytes' wheel (43 MB) does not fit beside the others: carry .bnb, the wheel unpacked with only its CPU and
  # the GPU's CUDA library (libbitsandbytes_cuda130.so for torch +cu130).
  [ -d .bnb ] && cp -r .bnb/* /tmp/site/
  export PYTHONPATH=/tmp/site:$PWD
fi
step versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__)"
step "gali info --check"
timeout "$(cap 180)" python3 -m gali_cli info --check 2>&1 | tee "$OUT/info-check.log"
step "decoding as a CUDA graph: every graph step held to the forward (small shape), then speed (Llama-3-8B shape)"
timeout "$(cap 90)" python3 benchmarks/bench_graph_decode.py --shape small --dtype float32 --train-len 256 \
  --lengths 300,1100 --tokens 24 --verify 2>&1 | grep -E "^\||Warn"
# GALI's table per offset (issue 26: GALI 0.90x the unpatched step after 128k, with noise 0.92x after 32k, before it)
timeout "$(cap 120)" python3 benchmarks/bench_graph_decode.py --shape llama3-8b --dtype bfloat16 --train-len 8192 \
  --lengths 32768 --tokens 10 --methods original,gali,gali-noise,self-extend --routes triton \
  --json "$OUT/graph-32k.json" 2>&1 | grep -E "^\||Warn" | tee "$OUT/graph-32k.md"
timeout "$(cap 120)" python3 benchmarks/bench_graph_decode.py --shape llama3-8b --dtype bfloat16 --train-len 8192 \
  --lengths 131072 --tokens 8 --methods original,gali --routes triton 2>&1 | grep -E "^\||Warn" | tee "$OUT/graph-128k.md"
step "the kernel's and the plan's tests, compiled"
TRITON_INTERPRET=0 timeout "$(cap 120)" python3 -m pytest -p no:cacheprovider -q -rfE tests/engine/kernels/test_triton_attention.py \
  tests/engine/kernels/test_triton_decode.py tests/engine/attention/test_plan.py 2>&1 | tail -30
step "prefill and decode: Llama-3-8B shape, bfloat16, every method, 8k and 32k"
timeout "$(cap 200)" python3 benchmarks/bench_speed.py --device cuda --dtype bfloat16 --shape llama3-8b \
  --train-len 8192 --factors 1,4 --one-process --rounds 1 --decode-tokens 16 --decode-factors "" \
  --variants sdpa,gali,gali-noise,self-extend,chunk-llama,rerope,leaky-rerope,dpe,string,lampe,anchor \
  --json "$OUT/bench-8b.json" >"$OUT/bench-8b.md" 2>"$OUT/bench-8b.err"; cat "$OUT/bench-8b.md"
step "128k tokens"
timeout "$(cap 150)" python3 benchmarks/bench_speed.py --device cuda --dtype bfloat16 --shape llama3-8b \
  --train-len 8192 --factors 16 --one-process --rounds 1 --decode-tokens 8 --decode-factors "" \
  --variants sdpa,gali,gali-noise --json "$OUT/bench-128k.json" >"$OUT/bench-128k.md" 2>"$OUT/bench-128k.err"
cat "$OUT/bench-128k.md"
step "the commands on CUDA (tests/cli/test_cuda_commands.py), then the default suite: each result as it happens"
TRITON_INTERPRET=0 timeout -k 5 "$(cap 120)" python3 -m pytest -p no:cacheprovider -v --timeout 100 --tb=short \
  tests/cli/test_cuda_commands.py >"$OUT/cuda-commands.log" 2>&1; grep -E "FAILED|passed|failed" "$OUT/cuda-commands.log"
# Straight into a file, no pipe: xdist's workers outlive a timeout and would hold a pipe open. The whole suite took
# 231 s with -n 14 on a machine that gave it 2 CPUs.
TRITON_INTERPRET=0 timeout -k 5 "$(cap 300)" python3 -m pytest -p no:cacheprovider -v -n 8 --timeout 100 \
  --tb=short >"$OUT/suite.log" 2>&1; pkill -9 -f pytest; grep -E "^(FAILED|ERROR)| FAILED " "$OUT/suite.log" | head -40
step done
