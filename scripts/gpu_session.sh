#!/usr/bin/env bash
# One part of the GPU work per call of the device tool (each part fits its 10-minute limit with margin), so a
# session's 30 minutes of device time go to measurements, not to runs cut short. Results land in $OUT (or
# ./gpu_out) as logs and JSON lines; copy the JSON lines into benchmarks/results/ and the numbers into
# BENCHMARKS.md.
#
#   scripts/gpu_session.sh verify    # every kernel test against the compiled kernels (then update
#                                    # fnx/pallas/dispatch.py VERIFIED_ON_GPU for the ops that pass)
#   scripts/gpu_session.sh kernels   # bench_kernels over the released shapes (+ --tune gemv)
#   scripts/gpu_session.sh decode    # full-model decode / MTP round at 4 and 8 layers, kernels on, FP8 + NVFP4
#   scripts/gpu_session.sh mesh tp=2,ep=1   # one mesh per call on nvidia-h200-x2 (tp=1,ep=1 first)
#   scripts/gpu_session.sh ple       # PLE end-to-end variants on the full-size table
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
ALL_KERNELS="gemv_nvfp4=pallas,moe_route=pallas,moe_experts=pallas,gdn_decode=pallas,qsa_decode_attention=pallas,qsa_index_scores=pallas,hc_boundary=pallas"
part=${1:?part: verify | kernels | decode | mesh SPEC | ple}
case "$part" in
  verify)
    timeout 540 python -m pytest -q -p no:cacheprovider tests/pallas 2>&1 | tee "$OUT/verify.log" | tail -30 ;;
  kernels)
    timeout 560 python scripts/bench_kernels.py --tune gemv --iters 10 --out "$OUT/bench_kernels.jsonl" \
      > "$OUT/bench_kernels.log" 2>&1
    cp fnx/pallas/gemv/configs/*.json "$OUT/" 2>/dev/null
    grep -c "TB/s" "$OUT/bench_kernels.log"; tail -3 "$OUT/bench_kernels.log" ;;
  decode)
    FNX_KERNELS=$ALL_KERNELS timeout 270 python scripts/bench_decode.py --layers 4,8 --contexts 8192 --reps 10 \
      --quant fp8+nvfp4 --out "$OUT/bench_decode.jsonl" 2>&1 | tee "$OUT/decode_fp8.log" | grep extrap
    timeout 270 python scripts/bench_decode.py --layers 4,8 --contexts 8192 --reps 10 \
      --out "$OUT/bench_decode.jsonl" 2>&1 | tee "$OUT/decode_bf16.log" | grep extrap ;;
  mesh)
    spec=${2:?mesh spec, e.g. tp=2,ep=1}
    timeout 560 python scripts/bench_decode.py --layers 4,8 --contexts 8192 --reps 10 --mesh "$spec" \
      --out "$OUT/bench_decode.jsonl" 2>&1 | tee "$OUT/mesh_${spec//[=,]/_}.log" | grep -v Warning | tail -4 ;;
  ple)
    timeout 560 python scripts/bench_ple.py --modes pageable --e2e --out "$OUT/bench_ple.jsonl" \
      > "$OUT/ple.log" 2>&1; tail -20 "$OUT/ple.log" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
