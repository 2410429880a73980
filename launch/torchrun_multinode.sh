#!/usr/bin/env bash
# spmd-engine across nodes with torchrun: run this same command on every node (ssh, pdsh, or one
# slurm task per node), each with its NODE_RANK; torchrun starts one process per GPU.
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER=node0 bash launch/torchrun_multinode.sh model=qwen3_32b ...
#   node 1:  NNODES=2 NODE_RANK=1 MASTER=node0 bash launch/torchrun_multinode.sh model=qwen3_32b ...
#
# Variables (slurm's are used when set, so `srun --ntasks-per-node=1 bash launch/torchrun_multinode.sh`
# works inside an allocation):
#   NNODES          number of nodes                       (default SLURM_NNODES, else 1)
#   NODE_RANK       this node's index 0..NNODES-1          (default SLURM_NODEID, else 0)
#   NPROC_PER_NODE  processes (GPUs) per node              (default: number of visible GPUs, else 1)
#   MASTER          host of node 0, reachable from all     (default: first host of SLURM_JOB_NODELIST)
#   MASTER_PORT     rendezvous port on MASTER              (default 29500)
#   RDZV_BACKEND    static (uses NODE_RANK) | c10d (torchrun assigns node ranks; NODE_RANK ignored)
#   RUN_ID          rendezvous id, same on all nodes       (default SLURM_JOB_ID, else spmd-engine)
# torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; the engine prefers them over slurm's.
set -euo pipefail

cd "${SPMD_ENGINE_DIR:-$(dirname "$0")/..}"
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  ((NPROC_PER_NODE > 0)) || NPROC_PER_NODE=1
fi
if [[ -z ${MASTER:-} ]]; then
  if [[ -n ${SLURM_JOB_NODELIST:-} ]] && command -v scontrol >/dev/null; then
    MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
  elif ((NNODES == 1)); then
    MASTER=127.0.0.1
  else
    echo "torchrun_multinode.sh: set MASTER to the host of node 0 (NNODES=$NNODES)" >&2
    exit 2
  fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_BACKEND=${RDZV_BACKEND:-static}
RUN_ID=${RUN_ID:-${SLURM_JOB_ID:-spmd-engine}}
PYTHON=${PYTHON:-python}

# Inside a slurm task, SLURM_PROCID is the node's task index, not the rank; the engine already
# prefers torchrun's RANK, this only keeps logs unambiguous.
unset SLURM_PROCID SLURM_LOCALID SLURM_NTASKS 2>/dev/null || true
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# export NCCL_NVLS_ENABLE=0      # cluster-specific, see launch/slurm.sbatch
# export NCCL_SOCKET_IFNAME=ib0

exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend="$RDZV_BACKEND" --rdzv_endpoint="$MASTER:$MASTER_PORT" --rdzv_id="$RUN_ID" \
  --max_restarts=0 \
  run.py "$@"
