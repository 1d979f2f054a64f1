#!/bin/bash
# The device machine's run for issue 26's graph decoding (docs/performance.md, "GPU: decoding as a CUDA graph"):
# correctness on a small shape (every graph step held to the forward), then speed on Llama-3-8B shapes, then
# `gali info --check` (its seam checks decode through the graph on a GPU), then the 32k prefill still unmeasured.
# Run from the repository root with .whl carried (benchmarks/gpu_session.sh says how it is filled).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gali-gpu}; mkdir -p "$OUT"
S=$(date +%s)
DEADLINE=${DEADLINE:-520}
step() { echo; echo "=== +$(( $(date +%s) - S ))s: $*"; }
cap() { local left=$(( DEADLINE - ($(date +%s) - S) )); (( left < $1 )) && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "pip failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site:$PWD
fi
step versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
step "correctness: small shape, float32 and bfloat16, every graph step held to the forward"
timeout "$(cap 90)" python3 benchmarks/bench_graph_decode.py --shape small --dtype float32 --train-len 256 \
  --lengths 300,1100 --tokens 24 --verify --json "$OUT/small32.json" 2>&1 | tee "$OUT/small32.md" | tail -30
timeout "$(cap 60)" python3 benchmarks/bench_graph_decode.py --shape small --dtype bfloat16 --train-len 256 \
  --lengths 1100 --tokens 24 --verify --json "$OUT/small16.json" 2>&1 | tail -16
step "speed: Llama-3-8B shape, bfloat16, 8k and 32k"
timeout "$(cap 250)" python3 benchmarks/bench_graph_decode.py --shape llama3-8b --dtype bfloat16 --train-len 8192 \
  --lengths 8192,32768 --tokens 16 --json "$OUT/8b.json" 2>&1 | tee "$OUT/8b.md" | tail -32
step "gali info --check"
timeout "$(cap 120)" python3 -m gali_cli info --check 2>&1 | tail -60 >"$OUT/info-check.log"; tail -8 "$OUT/info-check.log"
grep -i -E "fail|error" "$OUT/info-check.log" | head -10
step "prefill at 32k after the half-precision parts (ReRoPE, DPE, STRING, LaMPE)"
timeout "$(cap 150)" python3 benchmarks/bench_speed.py --device cuda --dtype bfloat16 --shape llama3-8b \
  --train-len 8192 --factors 4 --one-process --rounds 1 --decode-tokens 4 --decode-factors "" \
  --variants sdpa,rerope,dpe,string,lampe,self-extend --json "$OUT/prefill32k.json" >"$OUT/prefill32k.md" \
  2>"$OUT/prefill32k.err"; cat "$OUT/prefill32k.md"; tail -3 "$OUT/prefill32k.err"
step done
