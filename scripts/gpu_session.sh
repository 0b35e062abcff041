#!/usr/bin/env bash
# One part of the GPU work per call of the device tool (each part fits its 10-minute limit with margin), so a
# session's 30 minutes of device time go to measurements, not to runs cut short. Results land in $OUT (or
# ./gpu_out) as logs and JSON lines; copy the JSON lines into benchmarks/results/ and the numbers into
# BENCHMARKS.md.
#
# Several parts may follow one another in one call (each under its own timeout, env PART_S overrides):
#   scripts/gpu_session.sh verify    # every kernel test against the compiled kernels (then update
#                                    # fnx/pallas/dispatch.py VERIFIED_ON_GPU for the ops that pass)
#   scripts/gpu_session.sh tune      # GEMV tiles for the decode shapes (TUNE_M=5: the verify window's bucket;
#                                    # the table lands in $OUT: commit it as
#                                    # fnx/pallas/gemv/configs/<device>.json)
#   scripts/gpu_session.sh kernels   # bench_kernels (FAMS, FILTER) over the released shapes
#   scripts/gpu_session.sh moe       # the MoE decode layer benchmark (MOE_FILTER: a bench_kernels --filter regex)
#   scripts/gpu_session.sh moestep   # the 4-layer FP8 step with the MoE on XLA's gather path and on moe_decode
#                                    # (one process each; kernel tables), MOESTEP_ARGS extra probe_launch flags
#   scripts/gpu_session.sh decode    # full-model decode / MTP round at 4 and 8 layers, verified kernels on
#   scripts/gpu_session.sh full      # all 48 layers (FP8 + NVFP4, unrolled, fused projections): step, round, ledgers
#   scripts/gpu_session.sh mesh tp=2,ep=1   # one mesh per call on nvidia-h200-x2 (tp=1,ep=1 first; MESH_ARGS=--mesh-kernels
#                                           # runs the GEMV kernels per shard)
#   scripts/gpu_session.sh ple       # PLE end-to-end variants on the full-size table
#   scripts/gpu_session.sh pleengine # the engine on a host PLE store, every fetch variant (PLE_FETCHES)
#   scripts/gpu_session.sh uva       # the PLE rows read by the GPU from pinned host memory: its tests, then timed
#   scripts/gpu_session.sh ring      # the PLE rows through a pinned ring a host thread fills from a pageable mmap
#   scripts/gpu_session.sh hmm       # whether the GPU can read a pageable mmap of the table (HMM), and how fast
#   scripts/gpu_session.sh engine    # the engine's decode, synchronous vs overlapped (ENGINE_LAYERS, ENGINE_SLOTS)
#   scripts/gpu_session.sh probe     # launch gaps / dispatch / chained steps (PROBE_LAYERS, PROBE_ARGS, PROBE_S)
#   scripts/gpu_session.sh table     # every kernel of a decode step, with separate and with fused projections
#   scripts/gpu_session.sh ncu       # Nsight Compute counters of the MoE decode and GEMV kernels (NCU_CASES, NCU_KERNELS)
#   scripts/gpu_session.sh roundtable  # every kernel of the step, draft and verify at 8K (ROUND_CTX), matched to HLO
#   scripts/gpu_session.sh roundsweep  # roundtable's programs once per ROUND_VARIANTS entry, in one process
#   scripts/gpu_session.sh chunkprep   # op gdn_chunk_prep: compiled tests, then a 2,048-token chunk with and without
#                                      # it (sweep; CHUNKPREP_VARIANTS other variants against base, e.g.
#                                      # "inp: FNX_GDN_PREP_TILES=in_place=1;tok: FNX_GDN_SCAN_TILES=tokens_out=1")
#   scripts/gpu_session.sh cmdbuf    # XLA command-buffer update modes against a step's host time (CMDBUF_MODES)
#   scripts/gpu_session.sh moved     # which buffers move between step calls, per allocator (MOVED_ALLOCS)
#   scripts/gpu_session.sh graph     # host cost per kernel node of a bare chain of N kernels (GRAPH_NODES, GRAPH_MODES)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "parts: failures | verify | tune | kernels | moe | moestep | decode | full | engine | probe | table | ncu | roundtable | roundsweep | chunkprep | cmdbuf | graph | moved | mesh SPEC | ple | pleengine | uva | ring | hmm (several per call)" >&2; exit 2; }
while [ $# -gt 0 ]; do
part=$1; shift
echo "=== $part $(date +%T)"
case "$part" in
  failures)   # the named tests again, with their tracebacks
    timeout ${FAIL_S:-90} python -m pytest -q -p no:cacheprovider --tb=short ${FAIL_TESTS:?} 2>&1 \
      | tee "$OUT/failures.log" | grep -E "^E |Error|^FAILED|passed|failed" | head -40 ;;
  verify)  # VERIFY_FILES the test files, VERIFY_K a pytest -k expression (spaces allowed: passed quoted);
           # VERIFY_N pytest-xdist workers (the compiles run in parallel; the wheels travel in tmp/wheels, carried)
    if [ -n "${VERIFY_N:-}" ]; then
      python -c "import xdist" 2>/dev/null || { python -m pip install -q --no-index --no-deps --target tmp/pydeps \
        tmp/wheels/*.whl 2>&1 | tail -2; export PYTHONPATH=$PYTHONPATH:$PWD/tmp/pydeps; }
    fi
    ${VERIFY_N:+env XLA_PYTHON_CLIENT_PREALLOCATE=false} timeout ${VERIFY_S:-300} python -m pytest -q -p no:cacheprovider --durations=12 ${VERIFY_FILES:-tests/pallas} \
      ${VERIFY_N:+-n $VERIFY_N} ${VERIFY_K:+-k "$VERIFY_K"} 2>&1 \
      | tee "$OUT/verify.log" | tail -30 ;;
  tune)   # GEMV tiles for the shapes that carry the decode bytes; the table is kept in $OUT
    timeout ${TUNE_S:-240} python scripts/bench_kernels.py --tune gemv --tune-budget $(( ${TUNE_S:-240} - 40 )) \
      --tune-fmts ${TUNE_FMTS:-fp8 nvfp4 bf16} --tune-layers "${TUNE_LAYERS:-in_proj_qkv|gdn.out_proj|lm_head|shared|hc.up}" \
      --tune-m ${TUNE_M:-1} ${TUNE_ARGS:-} \
      --only --out "$OUT/bench_kernels.jsonl" > "$OUT/tune.log" 2>&1
    cp fnx/pallas/gemv/configs/*.json "$OUT/" 2>/dev/null
    grep "^tune" "$OUT/tune.log" ;;
  kernels)
    # VARIANTS ('LABEL: FNX_ENV=VALUE ...;...'): each case again per knob variant, in this process
    timeout ${KERNELS_S:-400} python scripts/bench_kernels.py --iters 10 --only ${FAMS:-gemv gdn qsa hc} \
      ${FILTER:+--filter "$FILTER"} ${VARIANTS:+--variants "$VARIANTS"} --out "$OUT/bench_kernels.jsonl" \
      > "$OUT/bench_kernels.log" 2>&1
    grep -c "TB/s" "$OUT/bench_kernels.log"; tail -3 "$OUT/bench_kernels.log" ;;
  moe)
    # MOE_APPS: applications per slope (each case compiles a program that unrolls them: ~35 s a case at 64)
    timeout ${MOE_S:-240} python scripts/bench_kernels.py --iters 10 --only moe ${MOE_FILTER:+--filter "$MOE_FILTER"} \
      ${VARIANTS:+--variants "$VARIANTS"} \
      --min-apps ${MOE_APPS:-24} --bracket --out "$OUT/bench_kernels.jsonl" > "$OUT/bench_moe.log" 2>&1
    grep -E "^moe_(decode|prefill)" "$OUT/bench_moe.log" | tail -40 ;;
  moestep)
    for k in moe_decode=reference moe_decode=pallas; do
      FNX_KERNELS=$k timeout ${MOESTEP_S:-150} python scripts/probe_launch.py --layers 4 --quant fp8 --fuse --fp8-head \
        --dispatch-only --no-round --kernel-table --calls 3 --chains 5 --label "moestep_$k" --out "$OUT/probe" \
        ${MOESTEP_ARGS:-} 2>&1 | grep -E '"part"|^ +[0-9.]+ us|Error' | cut -c1-300 | head -30
    done
    rm -rf "$OUT"/probe/trace_* "$OUT"/probe/decode_hlo* ;;
  decode)   # DECODE_QUANT bf16 | fp8 | fp8+nvfp4; DECODE_KERNELS a FNX_KERNELS value (empty: auto, the verified set);
            # DECODE_LAYERS (4,8: give DECODE_S >= 400 for both; 48 with fp8+nvfp4 fits one H200: the full model),
            # DECODE_ARGS extra flags (--unroll-stacked: the layout fnx.serve runs on a GPU; --no-scan: every layer separate)
    FNX_KERNELS=${DECODE_KERNELS:-} timeout ${DECODE_S:-270} python scripts/bench_decode.py --reps 5 --layers ${DECODE_LAYERS:-4,8} --ledger 5 \
      --contexts ${DECODE_CTX:-1024} --quant ${DECODE_QUANT:-bf16} ${DECODE_ARGS:-} --out "$OUT/bench_decode.jsonl" 2>&1 \
      | tee "$OUT/decode_${DECODE_QUANT:-bf16}.log" | grep -v Warning | tail -12 ;;
  full)    # FULL_LAYOUT: --unroll-stacked (default: the stacked params run unrolled, as served) or --no-scan
           # the whole 48-layer model at the released widths on one H200 (FP8 dense, NVFP4 experts, unrolled, fused
           # projections as served): decode step, MTP k=4 round, prefill 1K, ledgers with their top kernels (~5 min;
           # FULL_ARGS extra bench_decode flags, e.g. --no-fuse, or --keep-bf16 input_mix_weight for bf16 HC;
           # FULL_CTX the context, 1024 by default: issue 8's round target is at 8192, its QSA ones at 32K / 128K,
           # where the KV capacity also decides the QSA path, see fnx/pallas/qsa/README.md)
           # FULL_LAYERS: fewer layers (24 fit an 80 GB H100: per-layer questions such as the prefill chunk size)
    timeout ${FULL_S:-560} python scripts/bench_decode.py --reps 5 --layers ${FULL_LAYERS:-48} ${FULL_LAYOUT:---unroll-stacked} --ledger 5 --contexts ${FULL_CTX:-1024} \
      --quant fp8+nvfp4 ${FULL_ARGS:-} --out "$OUT/bench_decode.jsonl" > "$OUT/full48.log" 2>&1
    grep -E '^# ledger|"part": "decode"|Error' "$OUT/full48.log" | cut -c1-400 ;;
  engine)  # fnx.engine.Engine plain decode, synchronous against overlapped (ENGINE_LAYERS, ENGINE_SLOTS; ENGINE_SPEC=K
           # also MTP rounds with K drafts, synchronous against overlapped; ENGINE_CTX the context, ENGINE_ARGS more
           # bench_decode flags, e.g. "--quant fp8 --unroll-stacked --fp8-head" for the served layout, and
           # --engine-only to skip bench_decode's own step / round / prefill timings: the 48-layer engine run)
           # ENGINE_VLOG=1: with XLA's command-buffer and executable logs (timings then not comparable), the graph
           # re-records counted per program (module): which of the engine's programs still move a buffer per launch
    if [ "${ENGINE_VLOG:-0}" = 1 ]; then
      export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,gpu_executable=3
    fi
    timeout ${ENGINE_S:-300} python scripts/bench_decode.py --layers ${ENGINE_LAYERS:-4} --contexts ${ENGINE_CTX:-1024} --reps 5 \
      --engine ${ENGINE_TOKENS:-64} --engine-slots ${ENGINE_SLOTS:-1,8} --engine-spec ${ENGINE_SPEC:-0} ${ENGINE_ARGS:-} --out "$OUT/bench_decode.jsonl" \
      > "$OUT/engine.log" 2>&1
    grep -E "^# engine|Error" "$OUT/engine.log" | grep -v "^I1"
    if [ "${ENGINE_VLOG:-0}" = 1 ]; then
      unset TF_CPP_VMODULE; export TF_CPP_MIN_LOG_LEVEL=2
      # re-records per program over the whole run, then per program in each engine's timed phase (bench_decode
      # prints a "=== phase engine bSLOTS LABEL warm-up|timed" line before each engine run)
      awk '/Start GpuExecutable::ExecuteOnStream module:/ {m=$NF} /updated_allocs=/ {u[m]++}
           /Execute command buffer/ {e[m]++} END {for (k in e) printf "  %-40s re-records %d of %d launches\n", k, u[k], e[k]}' \
        "$OUT/engine.log" | sort -k4 -n -r | head -30
      awk '/^=== phase engine/ {p=$4" "$5" "$6} /^=== phase/ && !/engine/ {p=""}
           /Start GpuExecutable::ExecuteOnStream module:/ {m=$NF} p ~ /timed/ && /updated_allocs=/ {u[p" "m]++}
           p ~ /timed/ && /Execute command buffer/ {e[p" "m]++}
           END {for (k in e) printf "  %-60s re-records %d of %d launches\n", k, u[k], e[k]}' "$OUT/engine.log" | sort
      # (kept per run: several engine parts in one call each leave their log)
      mv "$OUT/engine.log" "$OUT/engine_vlog_$(date +%H%M%S).log"; gzip -f "$OUT"/engine_vlog_*.log
    fi ;;
  probe)   # where a decode step's wall time goes: dispatch, chained steps, gaps, command buffers (one process
           # per layer count; PROBE_ARGS e.g. "--no-scan" or "--dispatch-only")
    for n in ${PROBE_LAYERS:-4 12}; do
      timeout ${PROBE_S:-150} python scripts/probe_launch.py --layers $n --out "$OUT/probe" ${PROBE_ARGS:-} 2>&1 \
        | grep '"part"' | cut -c1-600
    done ;;
  cmdbuf)  # CMDBUF_LAYOUT: --unroll-stacked (default, as served) or --no-scan
           # XLA's command-buffer (CUDA graph) runtime modes against the host time of one decode step: one process
           # per XLA_FLAGS value (CMDBUF_LAYERS, unrolled, fused projections); the logits fingerprint must agree.
           # First, with XLA's command-buffer thunk logging (VLOG 3), how many graph updates the steps cause: each
           # "updated_allocs=" line is a re-record of the graph's nodes whose buffers moved since the last launch.
           # Update modes in JAX 0.11.2: ALWAYS_UPDATE (default), SKIP_TEMP (temporaries at fixed VMM addresses),
           # SKIP_PROFILED (also parameters / outputs that kept their address); both want the VMM allocator. The
           # names FULL_UPDATE_FREE / CUSTOM_LIBRARY_UPDATE_FREE tried in the eighth session no longer exist (a flag
           # parse error ends the process: why those runs wrote nothing).
    if [ -n "${CMDBUF_VLOG:-1}" ]; then
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout ${CMDBUF_S:-150} python scripts/probe_launch.py --io ${CMDBUF_IO:-plain} \
        --layers ${CMDBUF_LAYERS:-12} ${CMDBUF_LAYOUT:---unroll-stacked} --fuse --dispatch-only --no-round --reps 20 --chains 5 \
        --label "cmdbuf:vlog" --out "$OUT/probe" > "$OUT/cmdbuf_vlog.log" 2>&1
      echo "graph updates (updated_allocs lines): $(grep -c 'updated_allocs' "$OUT/cmdbuf_vlog.log")"
      grep 'updated_allocs' "$OUT/cmdbuf_vlog.log" | tail -4 | cut -c1-300
      grep -E '"part": "decode dispatch"' "$OUT/cmdbuf_vlog.log" | cut -c1-500
    fi
    modes=${CMDBUF_MODES:-"default|--xla_gpu_command_buffer_update_mode=SKIP_TEMP|--xla_gpu_command_buffer_update_mode=SKIP_PROFILED|--xla_gpu_enable_command_buffer="}
    IFS='|' read -ra mode_list <<< "$modes"
    for m in "${mode_list[@]}"; do
      flags=$([ "$m" = default ] && echo "" || echo "$m")
      alloc=$(case "$m" in *SKIP_*) echo XLA_PYTHON_CLIENT_ALLOCATOR=vmm ;; esac)   # (unset otherwise)
      env $alloc XLA_FLAGS="$flags" timeout ${CMDBUF_S:-150} python scripts/probe_launch.py \
        --layers ${CMDBUF_LAYERS:-12} ${CMDBUF_LAYOUT:---unroll-stacked} \
        --fuse --dispatch-only --no-round --reps 20 --chains 5 --label "cmdbuf:$m" --out "$OUT/probe" 2>&1 \
        | grep -E '"part": "decode dispatch"|Error|error:' | cut -c1-700
    done
    # where the host time of one step goes, command buffers kept on while profiling (CMDBUF_PROFILE=0 skips it)
    [ "${CMDBUF_PROFILE:-1}" = 0 ] || XLA_FLAGS="--xla_enable_command_buffers_during_profiling=true ${CMDBUF_PROFILE_FLAGS:-}" timeout ${CMDBUF_S:-150} \
      python scripts/probe_launch.py --layers ${CMDBUF_LAYERS:-12} ${CMDBUF_LAYOUT:---unroll-stacked} --fuse --dispatch-only --no-round \
      --reps 5 --chains 2 --calls 3 --host-profile --label "cmdbuf:profile${CMDBUF_PROFILE_FLAGS:-}" \
      --out "$OUT/probe" 2>&1 | grep -E '"part": "host profile"|Error|error:' | cut -c1-4000 ;;
  moved)   # which buffers of the served step move between calls, and what stops it: for each MOVED_ALLOCS entry
           # ALLOC[+MODE] (XLA_PYTHON_CLIENT_ALLOCATOR: bfc is the default, cuda_async frees in stream order; MODE an
           # --xla_gpu_command_buffer_update_mode, e.g. vmm+SKIP_TEMP: temporaries at fixed VMM addresses) one process
           # with XLA's command-buffer log (MOVED_VLOG, 3): the step plain and with stable IO, synchronous and chained,
           # then --addr-trace; the graph re-records (updated_allocs lines) counted per phase, the leaves that moved,
           # the dispatch / chained times. MOVED_DUMP=1: the first entry's XLA dump (its buffer assignment names the
           # allocation each index is) in $OUT/dump
    first=1
    for a in ${MOVED_ALLOCS:-bfc cuda_async}; do
      alloc=${a%%+*}; mode=$([ "$a" = "$alloc" ] && echo "" || echo "--xla_gpu_command_buffer_update_mode=${a#*+}")
      dump=$([ "${MOVED_DUMP:-0}" = 1 ] && [ $first = 1 ] && echo "--xla_dump_to=$OUT/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=^jit_step(_io)?$")
      first=0
      log="$OUT/moved_${a//+/_}.log"
      xf=$(echo $mode $dump)   # (XLA reads a non-empty XLA_FLAGS not starting with -- as a file name)
      env ${xf:+XLA_FLAGS="$xf"} XLA_PYTHON_CLIENT_ALLOCATOR=$alloc TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=${MOVED_VLOG:-3}${MOVED_VMODULE:+,$MOVED_VMODULE} \
        timeout ${MOVED_S:-200} python scripts/probe_launch.py --io both --addr-trace 8 --label "moved:$a" \
        --layers ${MOVED_LAYERS:-4} --unroll-stacked --fuse --quant ${MOVED_QUANT:-fp8} --fp8-head \
        --context ${MOVED_CTX:-8192} --dispatch-only --no-round --reps 20 --chains 3 --out "$OUT/probe" > "$log" 2>&1
      echo "--- $a (rc $?)"
      awk '/^=== phase/ {p=$3" "$4} /updated_allocs=/ {n[p]++} /Execute command buffer/ {e[p]++}
           END {for (q in e) print "  " q ": re-records " n[q]+0 " of " e[q] " launches"}' "$log" | sort
      grep -E '"part": "(decode dispatch|addresses)"' "$log" | sed -E 's/.*"part": /  /' | cut -c1-600
      grep -E "Error|error:" "$log" | grep -v "^I1" | head -3
    done
    # the dump keeps the step's files only (the device tool returns a limited number of files)
    # (the device tool returns at most 8 files: the step's buffer assignments and thunk sequences, compressed)
    if [ -d "$OUT/dump" ]; then
      for f in "$OUT"/dump/*jit_step*{buffer-assignment.txt,thunk_sequence_after_thunk_passes.txt}; do
        [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f" | sed -E 's/^module_[0-9]+\.//').gz"
      done
      rm -rf "$OUT/dump" "$OUT/probe"/decode_hlo_*
    fi; true ;;
  graph)   # the host cost per kernel node of a jitted program apart from any model (scripts/probe_graph.py):
           # N Pallas kernels in a chain (N = GRAPH_NODES; alone, donated and kept; with a weight argument each, or one
           # stacked weight argument; GRAPH_CASES), under each XLA setting of GRAPH_MODES. GRAPH_VLOG=1 first runs
           # the cases once with XLA's command-buffer log and counts, per case, the graph re-records (updated_allocs)
           # and the allocations that moved: which buffers make XLA re-record a step's whole graph every launch
    cases=${GRAPH_CASES:-"none:donated none:kept separate:donated stacked:donated"}
    if [ "${GRAPH_VLOG:-0}" = 1 ]; then
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout ${GRAPH_S:-120} python scripts/probe_graph.py \
        --nodes ${GRAPH_NODES:-50 400} --cases $cases --markers --label "graph:vlog" --out "$OUT/graph" \
        > "$OUT/graph_vlog.log" 2>&1
      awk '/^=== case/ {c=$3" N="$4} /updated_allocs=/ {n[c]++; split($0, a, "updated_allocs="); split(a[2], b, ";"); u[c]+=b[1]}
           /"part": "point"/ {match($0, /"calls": [0-9]+/); k[c]=substr($0, RSTART+9, RLENGTH-9)}
           END {for (c in k) print "re-records " c ": " n[c]+0 " of " k[c] " calls, allocations moved " u[c]+0}' \
        "$OUT/graph_vlog.log" | sort
    fi
    modes=${GRAPH_MODES-"default|--xla_gpu_command_buffer_update_mode=SKIP_TEMP|--xla_gpu_enable_command_buffer="}
    IFS='|' read -ra mode_list <<< "$modes"
    for m in "${mode_list[@]}"; do
      flags=$([ "$m" = default ] && echo "" || echo "$m")
      alloc=$(case "$m" in *SKIP_*) echo XLA_PYTHON_CLIENT_ALLOCATOR=vmm ;; esac)
      env $alloc XLA_FLAGS="$flags" timeout ${GRAPH_S:-120} python scripts/probe_graph.py \
        --nodes ${GRAPH_NODES:-50 400} --cases $cases --label "graph:$m" --out "$OUT/graph" 2>&1 \
        | grep -E '"part": "slopes"|Error|error:' | cut -c1-700
    done ;;
  table)   # every kernel of the 4-layer decode step (probe_launch --kernel-table), separate and fused projections,
           # and the chained step time of each in its own process (--fuse is a params change, not a kernel variant)
    for f in "" --fuse; do
      timeout ${TABLE_S:-150} python scripts/probe_launch.py --layers 4 --dispatch-only --no-round --kernel-table \
        --calls 3 --chains 5 $f --out "$OUT/probe" 2>&1 | grep -E '"part"|^ +[0-9.]+ us' | cut -c1-300 | head -30
    done ;;
  ncu)     # hardware counters of decode kernels (scripts/probe_ncu.py: the MoE decode layer, the GEMV kernel) through
           # Nsight Compute: DRAM throughput, issue slots, warp stall reasons, occupancy; NCU_CASES the probe's cases,
           # NCU_KERNELS a kernel-name regex, NCU_SECTIONS ncu sections. Each matching kernel of the probe's first
           # (compiling) call is replayed with its caches flushed; the clocks are left alone (METHOD.md)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu_bin" ] || { echo "ncu: not found"; continue; }
    secs=""; for s_ in ${NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis ComputeWorkloadAnalysis SchedulerStats \
      WarpStateStats Occupancy LaunchStats InstructionStats}; do secs="$secs --section $s_"; done
    # NCU_METRICS: extra metrics (e.g. "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio", the
    # stall reasons per issued instruction; one such run ended in a segmentation fault, 0b0ecf6); NCU_LOG the log's
    # name (several runs in one call); NCU_PROG another program to profile instead of the probe (a python script
    # and its flags, e.g. "scripts/probe_launch.py --layers 4 --quant fp8+nvfp4 --fuse --no-round --reps 1 --calls 1
    # --chains 1": every kernel of a decode step; NCU_KERNELS then picks which, NCU_COUNT caps how many)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout ${NCU_S:-300} "$ncu_bin" --clock-control none \
      --kernel-name "regex:${NCU_KERNELS:-moe_decode|fnx_gemv}" $secs ${NCU_METRICS:+--metrics "$NCU_METRICS"} \
      ${NCU_COUNT:+--launch-count $NCU_COUNT} \
      python ${NCU_PROG:-scripts/probe_ncu.py --reps 0 --cases ${NCU_CASES:-moe5_nvfp4 moe1_nvfp4 gemv_fp8}} \
      > "$OUT/${NCU_LOG:-ncu}.log" 2>&1
    echo "ncu rc=$? kernels profiled: $(grep -cE '^  [a-z_0-9]+.*\(([0-9]+, ){2}[0-9]+\)x' "$OUT/${NCU_LOG:-ncu}.log")"
    grep -E '^  [a-z_0-9]+.*x\(|DRAM Throughput|Duration|Memory Throughput|Issue Slots Busy|Achieved Occupancy|No Eligible|Registers Per|stalled|probe_ncu|ERR|rror' \
      "$OUT/${NCU_LOG:-ncu}.log" | cut -c1-160 | head -120 ;;
  roundtable)   # every kernel of the step and of the MTP round's draft and verify programs, matched to their HLO
                # (op_name, fused opcodes): 4 layers, FP8 dense + NVFP4 experts, fused projections, at ROUND_CTX
                # (8192: issue 8's round target); where the round's "other XLA" and cuBLAS time comes from (a library
                # kernel carries its instruction in the table's hlo_op). ROUND_ARGS default: the served heads.
                # ROUND_PREFILL=N: also one N-token prefill chunk's table (kernel_table_prefillN_*)
                # ROUND_BASE=<committed prefix>: a per-program diff against those tables (scripts/kernel_table_diff.py)
    timeout ${ROUND_S:-200} python scripts/probe_launch.py --layers 4 --quant fp8+nvfp4 --fuse --context ${ROUND_CTX:-8192} \
      --kernel-table --reps 5 --calls 3 --chains 2 --label roundtable --out "$OUT/probe" ${ROUND_PREFILL:+--prefill-table $ROUND_PREFILL} \
      ${ROUND_ARGS:---fp8-head --draft-vocab 32768 --draft-fp8} > "$OUT/roundtable.log" 2>&1
    grep -E '"part": "(kernel table|draft|verify|decode)"' "$OUT/roundtable.log" | cut -c1-260
    grep -E '^ +[0-9.]+ us' "$OUT/roundtable.log" | head -70
    # ROUND_BASE: a committed table prefix (e.g. 4615334): what moved against it, per program
    if [ -n "${ROUND_BASE:-}" ]; then
      python scripts/kernel_table_diff.py "$ROUND_BASE" "$OUT/probe" --probe --top 25 2>&1 | tee "$OUT/roundtable_diff.log"
    fi
    rm -rf "$OUT"/probe/trace_* "$OUT"/probe/decode_hlo* ;;
  roundsweep)   # ROUND_VARIANTS ('LABEL: FNX_ENV=VALUE ...;LABEL2: ...', the first the baseline, e.g. 'base: ;
                # pair: FNX_KERNELS=gemv_pair_many=pallas'): roundtable's 4-layer step, draft and verify programs at
                # ROUND_CTX compiled and profiled once per variant in one process (the model is built once), the
                # kernels and kernel time per program call, each program's wall time per call over 20 calls launched
                # back to back (launch gaps and host time in; `pick_winners.py --by chained`), and each variant's
                # kernel diff against the first; ROUND_PREFILL=N: an N-token prefill chunk per variant too (its
                # table; ROUND_ARGS with --no-round: the step and the chunk only); ROUND_HLO=1: each program's
                # optimized HLO too (tables/hlo_<program>_<label>.txt.gz)
                timeout ${SWEEP_S:-540} python scripts/probe_launch.py --layers 4 --quant fp8+nvfp4 --fuse \
      --context ${ROUND_CTX:-8192} --kernel-table --reps 2 --calls 3 --chains 1 --label roundsweep --out "$OUT/probe" \
      ${ROUND_PREFILL:+--prefill-table $ROUND_PREFILL} ${ROUND_HLO:+--save-hlo} \
      ${ROUND_ARGS:---fp8-head --draft-vocab 32768 --draft-fp8} --only-variants \
      --round-variants "${ROUND_VARIANTS:?ROUND_VARIANTS: the variants to compare}" > "$OUT/roundsweep.log" 2>&1
    echo "rc $? (roundsweep)"
    grep -E '^variant done' "$OUT/roundsweep.log"
    sed -n '/^variant  *decode kernels/,$p' "$OUT/roundsweep.log" | head -${SWEEP_LINES:-220}
    tail -3 "$OUT/roundsweep.log"
    rm -rf "$OUT"/probe/variants/*/trace_*
    # the device tool returns no folder that deep (probe/variants/LABEL/...): the tables again, one level up
    mkdir -p "$OUT/tables" && cp "$OUT"/probe/variants/*/kernel_table_*.jsonl "$OUT"/probe/variants/*/hlo_*.txt.gz \
      "$OUT/tables/" 2>/dev/null ;;
  chunkprep)   # op gdn_chunk_prep (the chunked GDN's per-chunk part in one launch, on under auto with the default
               # "tf32" products): its compiled tests, then the 4-layer 2,048-token chunk with the defaults against
               # XLA's prep and against the earlier defaults ("tf32x3", XLA's prep), one process; its bench cases
               # with CHUNKPREP_BENCH=1
    OUT="$OUT" VERIFY_FILES=tests/pallas/test_gdn.py VERIFY_K="${CHUNKPREP_K:-chunk_prep or chunked_prefill or tokens_layout or layer_prefill}" \
      VERIFY_S=${CHUNKPREP_VERIFY_S:-150} bash scripts/gpu_session.sh verify
    OUT="$OUT" SWEEP_S=${CHUNKPREP_SWEEP_S:-240} ROUND_PREFILL=2048 \
      ROUND_ARGS="--fp8-head --draft-vocab 32768 --draft-fp8 --no-round" \
      ROUND_VARIANTS="base: ;${CHUNKPREP_VARIANTS:-xlaprep: FNX_KERNELS=gdn_chunk_prep=reference;x3: \
FNX_GDN_SCAN_TILES=precision=tf32x3}" bash scripts/gpu_session.sh roundsweep | grep -E "^variant (done|failed)|^rc "
    grep -h '"gdn_chunk' "$OUT"/tables/kernel_table_prefill2048_*.jsonl | cut -c1-160
    if [ "${CHUNKPREP_BENCH:-0}" = 1 ]; then
      timeout ${CHUNKPREP_BENCH_S:-200} python scripts/bench_kernels.py --only gdn --filter gdn_chunk_prep \
        --out "$OUT/bench_kernels.jsonl" 2>&1 | tee "$OUT/chunkprep_bench.log" | grep -E "gdn_chunk_prep|Error" | cut -c1-200
    fi ;;
  mesh)
    spec=${1:?mesh spec, e.g. tp=2,ep=1}; shift
    timeout ${MESH_S:-560} python scripts/bench_decode.py --layers ${MESH_LAYERS:-4,8} --contexts 8192 --reps 10 \
      --mesh "$spec" ${MESH_ARGS:-} --out "$OUT/bench_decode.jsonl" 2>&1 | tee "$OUT/mesh_${spec//[=,]/_}.log" \
      | grep -v Warning | tail -4 ;;
  ple)   # PLE end to end on the full-size 51.2 GB table (written first, ~75 s): the real 4-layer model with its
         # rows from the host pageable store against the in-params table, then the stand-in step's fetch variants
    for store in ${PLE_DECODE_STORES-device pageable}; do   # PLE_DECODE_STORES= skips the real-model pair
      timeout ${PLE_S:-200} python scripts/bench_decode.py --layers 4 --contexts 1024 --reps 10 --ple-store $store \
        --ple-table-gb 51.2 --out "$OUT/bench_decode.jsonl" 2>&1 | grep -v Warning | tee -a "$OUT/ple.log" | tail -2
    done
    timeout ${PLE_E2E_S:-150} python scripts/bench_ple.py --table-gb 51.2 --modes , --e2e --iters 100 \
      --out "$OUT/bench_ple.jsonl" >> "$OUT/ple.log" 2>&1
    timeout ${PLE_COLD_S:-100} python scripts/bench_ple.py --table-gb 51.2 --modes , --e2e --e2e-cold --iters 50 \
      --e2e-variants device,sync,pipeline --out "$OUT/bench_ple.jsonl" >> "$OUT/ple.log" 2>&1
    grep -E "e2e|decode_ms" "$OUT/ple.log" | tail -30 ;;
  uva)   # the PLE table in pinned host memory, its rows read by the GPU inside every program (fnx/pallas/uva_gather):
         # its GPU tests first (a failed read stops here), then the 4-layer model and the engine on the full-size
         # table (UVA_TABLE_GB; pinned: needs that much free RAM) against the in-params table (device; UVA_STORES)
    timeout ${UVA_TEST_S:-120} python -m pytest -q -p no:cacheprovider tests/pallas/test_uva_gather.py \
      tests/ple/test_store.py -k "uva" 2>&1 | tail -4 | tee "$OUT/uva.log"
    grep -q " passed" "$OUT/uva.log" && ! grep -q "failed" "$OUT/uva.log" || { echo "uva tests did not pass"; continue; }
    timeout ${UVA_PLE_S:-150} python scripts/bench_ple.py --table-gb ${UVA_TABLE_GB:-51.2} --modes uva --iters 50 \
      --out "$OUT/bench_ple.jsonl" 2>&1 | grep -E " uva " | tee -a "$OUT/uva.log"
    for store in ${UVA_STORES:-device uva}; do   # the uva run also times the in-params engine (its baseline)
      timeout ${UVA_S:-240} python scripts/bench_decode.py --layers 4 --contexts 1024 --reps 10 --ple-store $store \
        --ple-table-gb ${UVA_TABLE_GB:-51.2} --engine 64 --engine-slots 1,8 --engine-spec ${UVA_SPEC:-4} \
        --out "$OUT/bench_decode.jsonl" 2>&1 | grep -v Warning | tee -a "$OUT/uva.log" | grep -E "^# engine|decode_ms|Error"
    done ;;
  ring)  # the PLE table in a pageable mmap, each program's rows copied by the store's host thread into a pinned ring
         # (fnx/ple/ring.py, fnx/pallas/ple_ring): its tests (CPU-side and GPU kernels against the thread; a failure
         # stops here), bench_ple (per call, chained in one program, cold), then the 4-layer model and the engine on
         # the full-size table (RING_TABLE_GB) with the in-params engine as the baseline in the same process
    timeout ${RING_TEST_S:-150} python -m pytest -q -p no:cacheprovider tests/pallas/test_ple_ring.py \
      tests/ple/test_ring.py 2>&1 | tail -6 | tee "$OUT/ring.log"
    grep -q " passed" "$OUT/ring.log" && ! grep -q "failed" "$OUT/ring.log" || { echo "ring tests did not pass"; continue; }
    timeout ${RING_PLE_S:-200} python scripts/bench_ple.py --table-gb ${RING_TABLE_GB:-51.2} --modes ring --iters 50 \
      --out "$OUT/bench_ple.jsonl" 2>&1 | grep -E " ring |ERROR" | tee -a "$OUT/ring.log"
    timeout ${RING_S:-240} python scripts/bench_decode.py --layers 4 --contexts 1024 --reps 10 --ple-store ring \
      --ple-table-gb ${RING_TABLE_GB:-51.2} --engine 64 --engine-slots ${RING_SLOTS:-1,8} --engine-spec ${RING_SPEC:-4} \
      --out "$OUT/bench_decode.jsonl" 2>&1 | grep -v Warning | tee -a "$OUT/ring.log" | grep -E "^# engine|decode_ms|Error" ;;
  hmm)   # can the GPU read a pageable mmap of the table (Linux HMM)? the driver's answers, then (only where it says
         # yes) the uva gather on an mmap'd HMM_GB table in a child process: rows checked, first touch and mapped timed
    timeout ${HMM_S:-240} python scripts/probe_hmm.py --gb ${HMM_GB:-4} --out "$OUT/probe_hmm.jsonl" 2>&1 \
      | tee "$OUT/hmm.log" | tail -3 ;;
  pleengine)   # the Engine on a host store: every ple_fetch variant (PLE_FETCHES) against the in-params table, 4
               # layers bf16, on the full-size table; first, where a fetch of never-touched rows goes (disk or faults)
    timeout ${PLE_FT_S:-150} python scripts/bench_ple.py --table-gb 51.2 --modes , --first-touch \
      --out "$OUT/bench_ple.jsonl" 2>&1 | tee -a "$OUT/pleengine.log" | grep -E "first-touch|rror"
    timeout ${PLE_ENGINE_S:-420} python scripts/bench_decode.py --layers 4 --contexts 1024 --reps 5 \
      --ple-store pageable --ple-table-gb 51.2 --engine ${ENGINE_TOKENS:-64} --engine-slots ${ENGINE_SLOTS:-1,16} \
      --engine-ple-fetch ${PLE_FETCHES:-pipeline,sync,callback-buffer} --out "$OUT/bench_decode.jsonl" 2>&1 \
      | grep -v Warning | tee -a "$OUT/pleengine.log" | grep -E "^# engine|rror" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
done
