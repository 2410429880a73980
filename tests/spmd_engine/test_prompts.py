import json

import pytest

from spmd_engine.prompts import (
    DEFAULT_PROMPTS,
    NO_TOKENIZER_ERROR,
    PromptRequest,
    load_tokenizer,
    read_prompts,
    tokenize,
    validate_prompt,
)

FRANCE = "What is the capital of France? Answer in one sentence."


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_cli_prompts_and_defaults():
    requests = read_prompts(["a", "b"], None)
    assert requests == [PromptRequest(0, "a", None, {}), PromptRequest(1, "b", None, {})]
    assert read_prompts("just one", None) == [PromptRequest(0, "just one", None, {})]
    assert read_prompts([[5, 6]], None) == [PromptRequest(0, None, [5, 6], {})]
    defaults = read_prompts(None, None)
    assert [r.prompt for r in defaults] == DEFAULT_PROMPTS and FRANCE in DEFAULT_PROMPTS
    bad = read_prompts(["ok", "", 3], None)
    assert [r.error for r in bad] == [None, "prompts[1]: prompt is empty",
                                      "prompts[2]: 'prompt' must be a string, got int"]


def test_job_level_mistakes_raise(tmp_path):
    with pytest.raises(ValueError, match="prompts and prompts_file are both set"):
        read_prompts(["a"], str(tmp_path / "p.jsonl"))
    with pytest.raises(ValueError, match=r"prompts_file='.*nope.jsonl': no such file"):
        read_prompts(None, str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="prompts is an empty list"):
        read_prompts([], None)


def test_jsonl_bad_lines_get_errors_and_good_lines_survive(tmp_path):
    lines = [
        json.dumps({"prompt": "hello", "temperature": 0.5, "max_tokens": 7, "seed": 3}),
        "",
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"temperature": 1.0}),
        json.dumps({"prompt": "x", "prompt_token_ids": [1]}),
        json.dumps({"prompt": "x", "temprature": 1.0}),
        json.dumps({"prompt": 5}),
        json.dumps({"prompt_token_ids": [1, "2"]}),
        json.dumps({"prompt_token_ids": [1, True]}),
        json.dumps({"prompt": "x", "max_tokens": "9"}),
        json.dumps({"prompt": "x", "top_k": 2.5}),
        json.dumps({"prompt": "x", "temperature": True}),
        json.dumps({"prompt": "x", "ignore_eos": 1}),
        json.dumps({"prompt": ""}),
        json.dumps({"prompt_token_ids": []}),
        "   ",
        json.dumps({"prompt_token_ids": [4, 5, 6], "ignore_eos": True, "top_p": 1, "seed": None}),
    ]
    requests = read_prompts(None, _write_lines(tmp_path / "p.jsonl", lines))
    assert [r.index for r in requests] == list(range(len(requests)))
    assert requests[0] == PromptRequest(0, "hello", None, {"temperature": 0.5, "max_tokens": 7, "seed": 3})
    assert requests[-1] == PromptRequest(15, None, [4, 5, 6], {"ignore_eos": True, "top_p": 1, "seed": None})
    errors = [r.error for r in requests[1:-1]]
    assert errors == [
        "prompts_file line 3: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        "prompts_file line 4: expected a JSON object, got list",
        "prompts_file line 5: give exactly one of 'prompt' or 'prompt_token_ids'",
        "prompts_file line 6: give exactly one of 'prompt' or 'prompt_token_ids'",
        "prompts_file line 7: unknown key 'temprature' (allowed: prompt, prompt_token_ids, temperature, top_p, "
        "top_k, max_tokens, ignore_eos, seed)",
        "prompts_file line 8: 'prompt' must be a string, got int",
        "prompts_file line 9: 'prompt_token_ids' must be a list of integers",
        "prompts_file line 10: 'prompt_token_ids' must be a list of integers",
        "prompts_file line 11: 'max_tokens' must be an integer, got str",
        "prompts_file line 12: 'top_k' must be an integer, got float",
        "prompts_file line 13: 'temperature' must be a number, got bool",
        "prompts_file line 14: 'ignore_eos' must be true or false, got int",
        "prompts_file line 15: prompt is empty",
        "prompts_file line 16: prompt is empty",
    ]
    assert all(r.prompt is None and r.prompt_token_ids is None for r in requests[1:-1])


def test_tokenize_without_tokenizer(tmp_path):
    requests = [PromptRequest(0, "text", None, {}), PromptRequest(1, None, [1, 2], {}),
                PromptRequest(2, None, None, {}, "earlier error")]
    assert tokenize(requests, None, chat_template=True) is requests
    assert [r.error for r in requests] == [NO_TOKENIZER_ERROR, None, "earlier error"]
    assert requests[1].prompt_token_ids == [1, 2]
    assert load_tokenizer(tmp_path) is None and load_tokenizer(None) is None


def test_tokenize_chat_template_and_plain(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    chat, ids = tokenize([PromptRequest(0, FRANCE, None, {}), PromptRequest(1, None, [7], {})], tokenizer, True)
    text = tokenizer.decode(chat.prompt_token_ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(f"<|im_start|>user\n{FRANCE}<|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt_token_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # no doubled specials
    assert ids.prompt_token_ids == [7]
    [plain] = tokenize([PromptRequest(0, FRANCE, None, {})], tokenizer, chat_template=False)
    assert plain.prompt_token_ids == tokenizer.encode(FRANCE) and tokenizer.decode(plain.prompt_token_ids) == FRANCE
    assert all(r.error is None for r in (chat, ids, plain))


def test_validate_prompt():
    assert validate_prompt([], 100, 10) == "prompt is empty"
    assert validate_prompt([1, 2, 3, 99999], 49152, 10) == \
        "prompt_token_ids[3]=99999 is outside the vocabulary [0, 49152)"
    assert validate_prompt([-1], 100, 10) == "prompt_token_ids[0]=-1 is outside the vocabulary [0, 100)"
    assert validate_prompt([1] * 5000, 100, 4096) == "prompt has 5000 tokens; max_model_len=4096 allows at most 4095"
    assert validate_prompt([1] * 10, 100, 10) == "prompt has 10 tokens; max_model_len=10 allows at most 9"
    assert validate_prompt([1] * 9, 100, 10) is None and validate_prompt([0, 99], 100, 10) is None
