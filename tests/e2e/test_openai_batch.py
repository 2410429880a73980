"""The OpenAI batch format through `python run.py`: custom_id kept, a bad body field is one error row,
and output_format=openai writes OpenAI batch output objects."""
from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.engine_args import tiny_args, write_prompts_file
from tests.helpers.run_engine import read_outputs, run_engines

SYSTEM_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "x", "messages": SYSTEM_CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, "n": 1}},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon", "max_tokens": 4, "seed": 3, "logprobs": 1}},
    {"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": SYSTEM_CHAT, "logit_bias": {"5": 1}, "max_tokens": 4}},
    {"prompt": "our own line", "max_tokens": 3},
]


def test_openai_batch_round_trip(tiny_qwen3: Path, tmp_path: Path):
    prompts = write_prompts_file(tmp_path / "batch.jsonl", LINES)
    rows_dir, openai_dir = tmp_path / "rows", tmp_path / "openai"
    runs = run_engines([tiny_args(tiny_qwen3, rows_dir, prompts),
                        tiny_args(tiny_qwen3, openai_dir, prompts, output_format="openai")], tmp_path, 300)
    for run in runs:
        run.check()
    chat, cmpl, bad, own = read_outputs(rows_dir)
    assert [r.get("custom_id") for r in (chat, cmpl, bad, own)] == ["chat-1", "cmpl-1", "bad-1", None]
    assert chat["error"] is None and chat["prompt"] == "system: Be brief.\nuser: Hi\nassistant: "
    assert len(chat["token_ids"]) == 5 and len(chat["logprobs"]) == 5
    assert len(chat["logprobs"][0]["top_logprobs"]) == 2
    assert cmpl["error"] is None and len(cmpl["token_ids"]) == 4 and cmpl["prompt"] == "Once upon"
    assert len(cmpl["prompt_token_ids"]) == len("Once upon")  # one byte a token: as written, no chat template
    assert bad["finish_reason"] == "error" and "logit_bias" in bad["error"] and "not supported" in bad["error"]
    assert own["error"] is None and len(own["token_ids"]) == 3

    objects = [json.loads(line) for line in (openai_dir / "outputs.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in objects] == ["chat-1", "cmpl-1", "bad-1", None]
    ok = objects[0]["response"]
    assert ok["status_code"] == 200 and objects[0]["error"] is None
    body = ok["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == chat["text"]
    assert body["usage"] == {"prompt_tokens": len(chat["prompt_token_ids"]), "completion_tokens": 5,
                             "total_tokens": len(chat["prompt_token_ids"]) + 5}
    assert len(body["choices"][0]["logprobs"]["content"]) == 5
    assert objects[1]["response"]["body"]["object"] == "text_completion"
    assert objects[1]["response"]["body"]["choices"][0]["text"] == cmpl["text"]
    assert objects[2]["response"] is None and "logit_bias" in objects[2]["error"]["message"]
