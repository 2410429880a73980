export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash .devdeps/install.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/devsite:$PWD
date -u; git log --oneline -1 2>/dev/null
timeout 200 python -m pytest -q -x tests/gpu/test_decode_cuda.py 2>&1 | tail -15
bench() { python run.py model=qwen3 model.load_format=dummy workload=bench hydra.run.dir=/tmp/r_$RANDOM 2>&1 | grep -E "bench: |bench decode|bench mixed" | cut -c1-220 | head -6; }
for i in 1 2 3; do
  echo "== new $i"; bench
  sed -i 's/^PREPARE_QK_IN_KERNEL = True/PREPARE_QK_IN_KERNEL = False/' kernels/decode_attention_cuda.py
  echo "== old $i"; bench
  sed -i 's/^PREPARE_QK_IN_KERNEL = False/PREPARE_QK_IN_KERNEL = True/' kernels/decode_attention_cuda.py
done
timeout 150 python -m pytest -q tests/gpu/test_cuda_graphs.py tests/gpu/test_qwen3_shape.py tests/gpu/test_pdl.py tests/gpu/test_piecewise_graphs.py 2>&1 | tail -8
