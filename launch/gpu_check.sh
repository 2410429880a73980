#!/usr/bin/env bash
# The GPU checks and bench runs behind docs/PERFORMANCE.md, in one go on an H200 machine (2 GPUs for tp).
#   bash launch/gpu_check.sh [STAGE ...]
#   stages: tests fused sampler qwen3 qwen3_p1 qwen3_p95 sync bs1 prefill tp tp_sync qwen3_tp2 sweep profile pdl (default: all)
# Logs go to $OUT/log.txt (OUT defaults to ./gpu_check_out), every run's metrics.json to $OUT/metrics.tgz,
# and a summary table is printed last (also $OUT/summary.txt). Each stage has its own time limit.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="${PYTHONPATH:-}:$PWD" HYDRA_FULL_ERROR=1
OUT=${OUT:-$PWD/gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
stages=${*:-tests fused sampler qwen3 qwen3_p1 qwen3_p95 sync bs1 prefill tp tp_sync qwen3_tp2 sweep profile pdl}
TORCHRUN=(python -m torch.distributed.run --standalone --nproc_per_node=2)
BENCH=(model.load_format=dummy workload=bench)

note() { echo "=== $(date +%T) $*" | tee -a "$LOG"; }
run() {  # run NAME LIMIT_S CMD...: one engine job into $WORK/NAME
  local name=$1 limit=$2; shift 2
  note "$name: $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" "hydra.run.dir=$WORK/$name" 2>&1 | tee -a "$LOG" | grep -E "bench|generate:|requests,|CUDA|KV cache|rror"
  local rc=${PIPESTATUS[0]}
  note "$name: exit $rc after $((SECONDS - t0)) s"
}

note "device: $(nvidia-smi -L | tr '\n' ' ') torch $(python -c 'import torch; print(torch.__version__)')"
for stage in $stages; do
  case $stage in
    tests)
      note "tests: pytest tests/gpu (PDL's in stage pdl) + GPU kernel cases + the sampler on CUDA (no host sync, batch independence)"
      timeout -k 10 300 python -m pytest tests/gpu --ignore=tests/gpu/test_pdl.py tests/kernels/test_rms_norm.py tests/kernels/test_rotary.py \
        tests/kernels/test_silu_and_mul.py tests/kernels/test_sampling_noise.py tests/spmd_engine/test_sampler.py \
        -q -x -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -15 ;;
    fused)
      note "fused: launch/bench/bench_fused_ops.py"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 python launch/bench/bench_fused_ops.py 2>&1 | tee -a "$LOG" ;;
    sampler)
      note "sampler: one step's sampling of 256 rows x Qwen3 vocab (median ms)"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 60 python - <<'PY' 2>&1 | tee -a "$LOG"
import torch, triton.testing
from spmd_engine.executor.sampler import Sampler, SamplingRow
logits = torch.randn(256, 151936, device="cuda") * 2
sampler = Sampler(torch.device("cuda"))
flat = torch.randn(256, 151936, device="cuda") * 0.05  # nearly flat rows: a nucleus of ~140k tokens
for name, t, p, k, x in (("greedy", 0.0, 1.0, -1, logits), ("temperature 0.6", 0.6, 1.0, -1, logits),
                         ("temperature 0.6 top_p 0.95", 0.6, 0.95, -1, logits),
                         ("temperature 0.6 top_p 0.95 flat rows", 0.6, 0.95, -1, flat),
                         ("temperature 0.6 top_p 0.5 flat rows (rejections)", 0.6, 0.5, -1, flat),
                         ("temperature 0.6 top_k 20", 0.6, 1.0, 20, logits),
                         ("temperature 0.6 top_k 50 top_p 0.9", 0.6, 0.9, 50, logits),
                         ("temperature 0.6 top_k 2000 (sort)", 0.6, 1.0, 2000, logits)):
    rows = [SamplingRow(i, t, p, k, i, 7) for i in range(256)]
    ms = triton.testing.do_bench(lambda: sampler.sample(x, rows), warmup=20, rep=200, return_mode="median")
    print(f"sampler {name}: {ms:.3f} ms")
# the host side alone: how long sample_on_device takes to queue (no wait for the GPU on any path)
import time
for p, k in ((0.95, -1), (1.0, 20)):
    rows = [SamplingRow(i, 0.6, p, k, i, 7) for i in range(256)]
    torch.cuda.synchronize(); torch.cuda._sleep(200_000_000)  # keep the GPU busy ~0.1 s
    t0 = time.perf_counter(); sampler.sample_on_device(logits, rows); queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"sampler queue time top_p {p} top_k {k} behind a busy GPU: {1000 * queued:.2f} ms (a sync would wait ~100 ms)")
PY
      ;;
    qwen3)
      CUDA_VISIBLE_DEVICES=0 run qwen3 200 python run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 ;;
    qwen3_p1)
      CUDA_VISIBLE_DEVICES=0 run qwen3_p1 200 python run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 sampling.top_p=1.0 ;;
    qwen3_p95)  # the bench with the engine's default nucleus (sampling.top_p 0.95): compare with qwen3_p1
      CUDA_VISIBLE_DEVICES=0 run qwen3_p95 200 python run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 workload.top_p=0.95 ;;
    sync)  # the same runs as qwen3_p1 and bs1, planning each step only after the last one's tokens
      CUDA_VISIBLE_DEVICES=0 run qwen3_p1_sync 200 python run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 \
        sampling.top_p=1.0 async_scheduling=false
      CUDA_VISIBLE_DEVICES=0 run bs1_sync 120 python run.py model=qwen3 "${BENCH[@]}" workload.num_seqs=1 \
        async_scheduling=false ;;
    bs1)
      CUDA_VISIBLE_DEVICES=0 run bs1 120 python run.py model=qwen3 "${BENCH[@]}" workload.num_seqs=1 ;;
    prefill)
      CUDA_VISIBLE_DEVICES=0 run prefill 120 python run.py model=qwen3 "${BENCH[@]}" workload.num_seqs=16 \
        workload.min_input_len=1024 workload.max_input_len=1024 workload.min_output_len=1 workload.max_output_len=1 ;;
    tp)
      CUDA_VISIBLE_DEVICES=0 run q8b_tp1 240 python run.py model=qwen3_8b "${BENCH[@]}"
      run q8b_tp2 240 "${TORCHRUN[@]}" run.py model=qwen3_8b "${BENCH[@]}" ;;
    qwen3_tp2)  # Qwen3-0.6B (16 heads, 8 KV heads) on 2 GPUs: the nano-vllm workload to completion
      run qwen3_tp2 200 "${TORCHRUN[@]}" run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 ;;
    tp_sync)
      run q8b_tp2_sync 240 "${TORCHRUN[@]}" run.py model=qwen3_8b "${BENCH[@]}" async_scheduling=false
      run q8b_tp2_model_reduce 240 "${TORCHRUN[@]}" run.py model=qwen3_8b "${BENCH[@]}" tp_reduce_dtype=model ;;
    sweep)  # conf/workload/sweep.yaml: a sweep that shows capacity (KV blocks against throughput)
      note "sweep: workload=sweep, block_size=16,256 x gpu_memory_utilization=0.08,0.9 x 2 repeats, eager"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 300 python run.py -m model=qwen3 model.load_format=dummy workload=sweep \
        enforce_eager=true +repeat=0,1 block_size=16,256 gpu_memory_utilization=0.08,0.9 \
        "hydra.sweep.dir=$WORK/sweep" 2>&1 | tee -a "$LOG" | grep -E "KV cache|generate:|requests,|rror" || true
      python launch/sweep_report.py "$WORK/sweep" 2>&1 | tee -a "$LOG" "$OUT/sweep.txt"
      python launch/sweep_report.py "$WORK/sweep" --best-by ttft_p99_ms --sort=-preempt --markdown --no-plot \
        2>&1 | tee -a "$LOG" "$OUT/sweep.txt" >/dev/null
      cp "$WORK/sweep/sweep.png" "$OUT/" 2>/dev/null || true ;;
    profile)
      note "profile: GPU time per decode step by kernel, batch 1 and 256 (launch/bench/kernel_profile.py)"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 200 python launch/bench/kernel_profile.py 2>&1 | grep -v Warning | tee -a "$LOG" ;;
    pdl)  # Programmatic Dependent Launch (debug.cuda_pdl): its checks, the graph A/B, then the engine with it on
      note "pdl: tests/kernels/test_pdl.py (sm_90 PTX order) + launch/bench/bench_pdl.py (decode step graph, off vs on)"
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 300 python -m pytest tests/kernels/test_pdl.py tests/gpu/test_pdl.py -q -x \
        -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -5
      CUDA_VISIBLE_DEVICES=0 timeout -k 10 300 python launch/bench/bench_pdl.py 2>&1 | grep -v Warning | tee -a "$LOG"
      CUDA_VISIBLE_DEVICES=0 run bs1_pdl 120 python run.py model=qwen3 "${BENCH[@]}" workload.num_seqs=1 debug.cuda_pdl=true
      CUDA_VISIBLE_DEVICES=0 run qwen3_pdl 200 python run.py model=qwen3 "${BENCH[@]}" max_model_len=4096 debug.cuda_pdl=true ;;
    *) note "unknown stage $stage" ;;
  esac
done

(cd "$WORK" && find . -name metrics.json | tar czf "$OUT/metrics.tgz" -T -) 2>/dev/null
python - "$WORK" <<'EOF' 2>&1 | tee -a "$LOG" "$OUT/summary.txt"
import json, sys
from pathlib import Path

def get(d, *keys):
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d

def f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)

rows = []
for path in sorted(Path(sys.argv[1]).glob("**/metrics.json")):
    m = json.loads(path.read_text())
    b = m.get("bench", {})
    t = get(b, "step_timing", "decode_max_batch") or {}
    wall = m.get("wall_time_s")
    rows.append([str(path.parent.relative_to(sys.argv[1])), m.get("status"), f(m.get("output_tokens_per_s"), "{:.0f}"),
                 f(m.get("prompt_tokens", 0) / wall if wall else None, "{:.0f}"), f(wall, "{:.2f}"),
                 f(get(m, "ttft", "p50_ms")), f(get(m, "itl", "p50_ms"), "{:.2f}"), f(get(m, "itl", "p90_ms"), "{:.2f}"),
                 f(b.get("fraction_of_floor"), "{:.2f}"), f(t.get("mean_seqs"), "{:.0f}"), f(t.get("step_ms"), "{:.2f}"),
                 f(t.get("schedule_ms"), "{:.2f}"), f(t.get("broadcast_ms"), "{:.2f}"), f(t.get("inputs_ms"), "{:.2f}"),
                 f(t.get("sample_ms"), "{:.2f}"), f(t.get("wait_ms"), "{:.2f}"), f(t.get("postprocess_ms"), "{:.2f}"),
                 f(100 * t["host_plan_fraction"] if "host_plan_fraction" in t else None),
                 f(t.get("gpu_idle_ms"), "{:.2f}"),
                 f(100 * t["gpu_idle_fraction"] if "gpu_idle_fraction" in t else None),
                 str(get(m, "kv_capacity", "blocks")),
                 (m.get("error") or "")[:60]])
head = ["run", "status", "out tok/s", "prompt tok/s", "wall s", "TTFT p50", "ITL p50", "ITL p90", "floor frac",
        "B", "step ms", "sched", "bcast", "inputs", "sample", "wait", "post", "plan %", "GPU idle", "idle %",
        "KV blocks", "error"]
widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
EOF
