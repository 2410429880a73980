export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash .devdeps/install.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/devsite:$PWD
date -u
timeout 120 python -m pytest -q -x tests/gpu/test_decode_cuda.py -k prologue 2>&1 | tail -3
bench() { python run.py model=qwen3 model.load_format=dummy workload=bench hydra.run.dir=/tmp/r_$RANDOM 2>&1 | grep -E "bench: |bench decode" | grep -v "by launch" | cut -c60-240 | head -4; }
setmax() { sed -i "s/^PREPARE_QK_MAX_ROWS = .*/PREPARE_QK_MAX_ROWS = $1/" kernels/decode_attention_cuda.py; }
for i in 1 2; do
  for m in "1 << 30" 128 0; do setmax "$m"; echo "== max $m ($i)"; bench; done
done
setmax "1 << 30"
date -u
