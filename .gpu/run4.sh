export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bash .devdeps/install.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/devsite:$PWD
date -u
timeout 100 python -m pytest -q tests/gpu/test_decode_cuda.py 2>&1 | tail -3
timeout 170 python -m pytest -q tests/gpu/test_cuda_graphs.py tests/gpu/test_qwen3_shape.py tests/gpu/test_pdl.py tests/gpu/test_piecewise_graphs.py 2>&1 | tail -3
date -u
