"""kv_cache_dtype=int8 on the Triton backend through the engine on CPU: the engine picks torch attention there, so
the test hands its model the Triton backend (the kernels under TRITON_INTERPRET), then generates. Chunked prompts
make prefill, mixed and decode steps; the greedy tokens equal the torch backend's."""
from types import SimpleNamespace

import pytest
import torch

from spmd_engine.models.layers.attention_backends.triton import TritonAttentionBackend

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors needs TRITON_INTERPRET")]


def test_triton_backend_gives_the_torch_tokens_over_an_int8_cache(tmp_path):
    from spmd_engine.config import engine_config_from_dict
    from spmd_engine.distributed import RankInfo
    from spmd_engine.engine import Engine
    from spmd_engine.job.prompts import PromptRequest
    from spmd_engine.models.layers.attention import use_attention_backend
    from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "ckpt", max_position_embeddings=128, tokenizer=False)
    prompts = [[5, 6, 7], list(range(40, 61)), [9] * 10 + [11]]

    calls = []

    def counted(fn):
        return lambda *args, **kwargs: calls.append(fn.__name__) or fn(*args, **kwargs)

    def run(triton: bool) -> list[list[int]]:
        raw = {"model": {"name": "tiny", "path": str(path), "load_format": "auto", "hf_config": {}},
               "workload": {"name": "chat"}, "sampling": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True},
               "device": "cpu", "dtype": "float32", "num_kv_blocks": 32, "block_size": 4, "max_num_seqs": 4,
               "max_num_batched_tokens": 12, "kv_cache_dtype": "int8"}
        llm = Engine(engine_config_from_dict(raw), RankInfo(0, 1, 0, "127.0.0.1", 0, "single"))
        try:
            assert llm.runner.kv_caches[0][0].dtype == torch.int8
            if triton:
                backend = TritonAttentionBackend()
                from spmd_engine.kernels import kv_int8

                backend.kv_int8 = SimpleNamespace(store_kv_int8=counted(kv_int8.store_kv_int8),
                                                  rotate_rows=counted(kv_int8.rotate_rows))
                use_attention_backend(llm.runner.model, backend)
            outs = llm.generate([PromptRequest(i, None, p) for i, p in enumerate(prompts)])
            timing = llm.last_run["step_timing"]
            assert all(timing[kind]["steps"] > 0 for kind in ("prefill", "mixed", "decode")), timing
            return [o.token_ids for o in outs]
        finally:
            llm.close()

    torch_tokens = run(triton=False)
    assert [len(t) for t in torch_tokens] == [6] * len(prompts)
    assert run(triton=True) == torch_tokens
    assert calls.count("store_kv_int8") > 0 and calls.count("rotate_rows") == 2 * calls.count("store_kv_int8")
