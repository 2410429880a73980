"""Chat input: prompts-file lines with `messages` rendered by the tokenizer's chat template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spmd_engine.config import ConfigError, engine_config_from_dict
from spmd_engine.job.prompts import read_prompts, tokenize
from spmd_engine.tokenizer import load_tokenizer
from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

SYSTEM_CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi?"}]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", vocab_size=300)
    return load_tokenizer(path)


def _file(tmp_path: Path, rows: list) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_messages_with_a_system_turn_render_through_the_template(tmp_path, tiny_tokenizer):
    requests = tokenize(read_prompts(None, _file(tmp_path, [{"messages": SYSTEM_CHAT, "max_tokens": 3}])),
                        tiny_tokenizer, True)
    (req,) = requests
    assert req.error is None and req.overrides == {"max_tokens": 3}
    assert req.prompt == "system: You are terse.\nuser: Hi?\nassistant: "
    assert req.prompt_token_ids == tiny_tokenizer.encode(req.prompt, add_special_tokens=False)


def test_bad_chat_lines_are_one_error_row_each(tmp_path, tiny_tokenizer):
    rows = [{"prompt": "x", "messages": SYSTEM_CHAT},
            {"messages": [{"role": "tool", "content": "x"}]},
            {"messages": []},
            {"messages": SYSTEM_CHAT, "chat_template_kwargs": [1]},
            {"messages": SYSTEM_CHAT}]
    requests = tokenize(read_prompts(None, _file(tmp_path, rows)), tiny_tokenizer, True)
    assert [r.error for r in requests] == [
        "prompts_file line 1: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'",
        "prompts_file line 2: messages[0].role must be one of system, user, assistant, got 'tool'",
        "prompts_file line 3: 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
        "prompts_file line 4: 'chat_template_kwargs' must be a JSON object, got list",
        None]


def test_a_template_error_is_that_row_only(tmp_path, tiny_tokenizer):
    import copy
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rows = [{"messages": SYSTEM_CHAT}, {"messages": SYSTEM_CHAT[1:]}]
    first, second = tokenize(read_prompts(None, _file(tmp_path, rows)), tok, True)
    assert "chat template" in first.error and "no system turns" in first.error
    assert second.error is None and second.prompt == "Hi?"


def test_chat_template_kwargs_reach_the_template_line_over_job(tmp_path, tiny_tokenizer):
    import copy
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    rows = [{"messages": SYSTEM_CHAT[1:]},
            {"messages": SYSTEM_CHAT[1:], "chat_template_kwargs": {"enable_thinking": True}}]
    job_wide, line_wins = tokenize(read_prompts(None, _file(tmp_path, rows)), tok, True, {"enable_thinking": False})
    assert job_wide.prompt == "Hi?<no-think>"
    assert line_wins.prompt == "Hi?"


def test_job_wide_chat_template_kwargs_key():
    base = {"model": {"name": "dummy", "load_format": "dummy", "hf_config": {}}, "sampling": {}}
    cfg = engine_config_from_dict({**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="chat_template_kwargs must be a group of keys"):
        engine_config_from_dict({**base, "chat_template_kwargs": "x"}).validate(1)


def test_smollm2_renders_a_system_turn(tmp_path, smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    (req,) = tokenize(read_prompts(None, _file(tmp_path, [{"messages": SYSTEM_CHAT}])), tokenizer, True)
    assert req.error is None
    assert "You are terse." in req.prompt and req.prompt.rstrip().endswith("assistant")
    assert req.prompt_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
