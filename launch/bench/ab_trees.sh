#!/usr/bin/env bash
# A/B of this checkout against another source tree on one GPU, runs alternated on the same machine:
#   bash launch/bench/ab_trees.sh BASE_DIR        (e.g. BASE_DIR from `git worktree add /tmp/base <commit>`)
# Runs the nano-vllm bench twice per tree (base, new, new, base), then kv_cache_dtype=fp8 and batch 1 once per
# tree, each `python run.py model=qwen3 model.load_format=dummy workload=bench ...`, and prints each run's
# throughput, ITL and fraction of the floor. Logs go to $OUT (default ./ab_out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BASE=$(cd "${1:?usage: ab_trees.sh BASE_DIR}" && pwd); NEW=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$PWD/ab_out}; mkdir -p "$OUT"
nvidia-smi -L
one() {  # one NAME TREE KEY=VALUE...
  local name=$1 tree=$2; shift 2; local t0=$SECONDS
  (cd "$tree" && PYTHONPATH="${PYTHONPATH:-}:$tree" timeout -k 5 300 python run.py model=qwen3 model.load_format=dummy \
    "$@" "hydra.run.dir=/tmp/ab_trees/$name") > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $((SECONDS - t0)) s: $*"; grep -hE "output tok/s|of the floor" "$OUT/$name.log" | tail -2
}
one base_bench "$BASE" workload=bench; one new_bench "$NEW" workload=bench
one base_fp8 "$BASE" workload=bench kv_cache_dtype=fp8; one new_fp8 "$NEW" workload=bench kv_cache_dtype=fp8
one base_bs1 "$BASE" workload=bench workload.num_seqs=1; one new_bs1 "$NEW" workload=bench workload.num_seqs=1
one new_bench2 "$NEW" workload=bench; one base_bench2 "$BASE" workload=bench
