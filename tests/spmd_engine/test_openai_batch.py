"""OpenAI batch lines translated into our request keys; unsupported body fields named in the error."""
from __future__ import annotations

import json

from spmd_engine.job.openai_batch import batch_output
from spmd_engine.job.prompts import read_prompts

CHAT = "/v1/chat/completions"


def _read(tmp_path, rows):
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_prompts(None, str(path))


def test_batch_lines_become_requests(tmp_path):
    ok, cmpl, ids, bad, bad_url, two = _read(tmp_path, [
        {"custom_id": "a", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7, "stop": "\n",
                  "logprobs": True, "top_logprobs": 3, "stream": False, "chat_template_kwargs": {"k": 1}}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 2}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6]}},
        {"custom_id": "d", "method": "POST", "url": CHAT,
         "body": {"messages": [{"role": "user", "content": "x"}], "tools": [], "n": 2}},
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "f", "method": "POST", "url": CHAT, "body": {"prompt": "p"}},
    ])
    assert ok.error is None and ok.custom_id == "a" and ok.api == "chat"
    assert ok.overrides == {"max_tokens": 7, "stop": "\n", "logprobs": 3} and ok.chat_template_kwargs == {"k": 1}
    assert cmpl.prompt == "p" and cmpl.overrides == {"logprobs": 2} and cmpl.api == "completions"
    assert ids.prompt_token_ids == [5, 6]
    assert bad.custom_id == "d" and bad.error.endswith("body field(s) not supported by this engine: tools "
                                                       "(url /v1/chat/completions)")  # n is supported
    assert bad_url.custom_id == "e" and "'url' must be" in bad_url.error
    assert "not supported" in two.error and "prompt" in two.error


def test_batch_output_of_an_error_row():
    out = batch_output([{"index": 0, "custom_id": "x", "finish_reason": "error", "error": "bad"}], "chat", "m")
    assert out["custom_id"] == "x" and out["response"] is None and out["error"]["message"] == "bad"
