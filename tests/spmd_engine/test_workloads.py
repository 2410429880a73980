from spmd_engine.workloads import bench_requests


def test_bench_reproduces_the_nano_vllm_workload_to_the_token():
    requests = bench_requests({})
    assert len(requests) == 256
    assert sum(len(r.prompt_token_ids) for r in requests) == 142_827
    assert sum(r.overrides["max_tokens"] for r in requests) == 133_966
    assert all(0 <= t <= 10_000 for r in requests for t in r.prompt_token_ids)
    assert requests[0].overrides == {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
                                     "max_tokens": requests[0].overrides["max_tokens"]}


def test_latency_mode_is_one_sequence():
    assert len(bench_requests({"num_seqs": 1})) == 1
