export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash .devdeps/install.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/devsite:$PWD
date -u
bench() { python run.py model=qwen3 model.load_format=dummy workload=bench workload.num_seqs=$1 hydra.run.dir=/tmp/r_$RANDOM 2>&1 | grep -E "bench: |bench decode steps:|ITL" | cut -c60-230 | head -4; }
setmax() { sed -i "s/^PREPARE_QK_MAX_ROWS = .*/PREPARE_QK_MAX_ROWS = $1/" kernels/decode_attention_cuda.py; }
for n in 1 32; do for i in 1 2; do
  for m in "1 << 30" 0; do setmax "$m"; echo "== seqs $n max $m ($i)"; bench $n; done
done; done
setmax "1 << 30"
date -u
