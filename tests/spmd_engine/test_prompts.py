import json

import pytest

from spmd_engine.job.prompts import (
    DEFAULT_PROMPTS,
    NO_TOKENIZER_ERROR,
    PromptRequest,
    read_prompts,
    tokenize,
    validate_prompt,
)
from spmd_engine.tokenizer import load_tokenizer

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
    requests = read_prompts(None, _write_lines(tmp_path / "p.jsonl", lines + ["", "  "]))  # blank at the end: no rows
    assert [r.index for r in requests] == list(range(len(lines)))  # line N is request N - 1, blank lines too
    assert requests[0] == PromptRequest(0, "hello", None, {"temperature": 0.5, "max_tokens": 7, "seed": 3})
    assert requests[-1] == PromptRequest(17, None, [4, 5, 6], {"ignore_eos": True, "top_p": 1, "seed": None})
    errors = [r.error for r in requests[1:-1]]
    assert errors == [
        "prompts_file line 2: the line is blank (each line is one request)",
        "prompts_file line 3: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        "prompts_file line 4: expected a JSON object, got list",
        "prompts_file line 5: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'",
        "prompts_file line 6: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'",
        "prompts_file line 7: unknown key 'temprature' (allowed: prompt, prompt_token_ids, messages, "
        "temperature, top_p, top_k, max_tokens, ignore_eos, seed, stop, stop_token_ids, min_tokens, "
        "include_stop_str_in_output, logprobs, prompt_logprobs, min_p, repetition_penalty, presence_penalty, "
        "frequency_penalty, n, structured_outputs, chat_template_kwargs)",
        "prompts_file line 8: 'prompt' must be a string, got int",
        "prompts_file line 9: 'prompt_token_ids' must be a list of integers",
        "prompts_file line 10: 'prompt_token_ids' must be a list of integers",
        "prompts_file line 11: 'max_tokens' must be an integer, got str",
        "prompts_file line 12: 'top_k' must be an integer, got float",
        "prompts_file line 13: 'temperature' must be a number, got bool",
        "prompts_file line 14: 'ignore_eos' must be true or false, got int",
        "prompts_file line 15: prompt is empty",
        "prompts_file line 16: prompt is empty",
        "prompts_file line 17: the line is blank (each line is one request)",
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


def test_an_openai_completions_prompt_is_taken_as_written(tmp_path):
    """vLLM's run-batch: /v1/completions takes the prompt as written, /v1/chat/completions gets the template."""
    from tests.helpers.tiny_checkpoints import make_tiny_checkpoint

    tokenizer = load_tokenizer(make_tiny_checkpoint(tmp_path / "ckpt"))
    body = {"prompt": "Once upon", "max_tokens": 4}
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body},
             {"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Once upon"}]}},
             {"prompt": "Once upon"}]
    cmpl, chat, own = tokenize(read_prompts(None, _write_lines(tmp_path / "p.jsonl", map(json.dumps, lines))),
                               tokenizer, chat_template=True)
    assert cmpl.prompt_token_ids == tokenizer.encode("Once upon") and cmpl.prompt == "Once upon"
    assert tokenizer.decode(chat.prompt_token_ids) == "user: Once upon\nassistant: "
    assert own.prompt_token_ids == chat.prompt_token_ids  # our own text lines keep chat_template=true


def test_a_repeated_custom_id_is_an_error_row(tmp_path):
    """The OpenAI batch format requires unique custom_ids: the first line runs, each repeat is an error row
    that names its line, the id and the line that used it first."""
    def line(custom_id, prompt):
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": prompt}})

    lines = [line("a", "first"), line("b", "other"), line("a", "again"), line("a", "third"), line("c", "last")]
    requests = read_prompts(None, _write_lines(tmp_path / "p.jsonl", lines))
    assert [r.custom_id for r in requests] == ["a", "b", "a", "a", "c"]
    assert [r.prompt for r in requests] == ["first", "other", None, None, "last"]
    assert [r.error for r in requests] == [None, None, *[
        f"prompts_file line {n}: duplicate custom_id 'a' (first on line 1); custom_ids must be unique in a batch file"
        for n in (3, 4)], None]


def test_a_prompt_too_long_for_any_tokenization_is_not_tokenized(smollm2_dir):
    """A text with more characters than max_model_len tokens can hold (the tokenizer's longest token, times
    the normalization slack, per token) is an error row before the tokenizer sees it; one at the bound is
    tokenized; the bound holds for the longest token repeated (81 characters in SmolLM2)."""
    from spmd_engine.job.prompt_chars import NORMALIZATION_SLACK, prompt_char_limit

    real = load_tokenizer(smollm2_dir)
    limit = prompt_char_limit(real, 32)
    longest = max(real.get_vocab(), key=len)
    assert limit.chars_per_token == len(longest) == 81 and limit.max_chars == NORMALIZATION_SLACK * 81 * 32
    text = real.convert_tokens_to_string([longest]) * 31  # 31 tokens of 81 characters: fits max_model_len=32
    assert len(real.encode(text)) < 32 and limit.problem(text) is None

    class Spy:
        """The real tokenizer, counting the characters it is asked to encode."""
        chat_template = real.chat_template
        encoded: list[int] = []

        def get_vocab(self):
            return real.get_vocab()

        def apply_chat_template(self, *args, **kwargs):
            return real.apply_chat_template(*args, **kwargs)

        def encode(self, text, **kwargs):
            self.encoded.append(len(text))
            return real.encode(text, **kwargs)

    spy = Spy()
    huge, fits = "x" * 5_000_000, "x" * limit.max_chars
    requests = [PromptRequest(0, huge, None, {}), PromptRequest(1, fits, None, {}),
                PromptRequest(2, None, None, {}, messages=[{"role": "user", "content": huge}])]
    tokenize(requests, spy, chat_template=False, char_limit=limit)
    assert requests[0].error == ("prompt has 5,000,000 characters; max_model_len=32 tokens hold at most 10,368 "
                                 "with this tokenizer (not tokenized)") and requests[0].prompt_token_ids is None
    assert requests[1].error is None and requests[1].prompt_token_ids
    assert spy.encoded == [len(fits)]  # the 5 MB texts never reached the tokenizer
    assert requests[2].error.startswith("prompt has 5,000,1") and requests[2].prompt_token_ids is None  # rendered


def test_validate_prompt():
    assert validate_prompt([], 100, 10) == "prompt is empty"
    assert validate_prompt([1, 2, 3, 99999], 49152, 10) == \
        "prompt_token_ids[3]=99999 is outside the vocabulary [0, 49152)"
    assert validate_prompt([-1], 100, 10) == "prompt_token_ids[0]=-1 is outside the vocabulary [0, 100)"
    assert validate_prompt([1] * 5000, 100, 4096) == "prompt has 5000 tokens; max_model_len=4096 allows at most 4095"
    assert validate_prompt([1] * 10, 100, 10) == "prompt has 10 tokens; max_model_len=10 allows at most 9"
    assert validate_prompt([1] * 9, 100, 10) is None and validate_prompt([0, 99], 100, 10) is None


# (raw line bytes, words its one-line error must contain) — each of these once ended the whole job,
# or (NEL/LINE SEPARATOR) was split into two broken lines by a text-mode line split
HOSTILE_LINES = [
    (b'{"prompt":"caf\xe9"}', ["not UTF-8", "0xe9", "byte 15"]),  # latin-1, not UTF-8
    (b"[" * 100_000 + b"]" * 100_000, ["nested too deeply"]),  # RecursionError in json
    (b'{"prompt":"a \\ud800"}', ["not valid Unicode", "U+D800"]),  # lone surrogate: TypeError in tokenizers
    (b'{"prompt_token_ids":[' + b"9" * 5000 + b"]}", ["invalid JSON value", "4300 digits"]),  # int() limit
    (b'{"prompt":"hi","max_tokens":1e999}', ["'max_tokens' must be an integer, got float"]),
    (b'{"prompt":"a\x00b"}', ["invalid JSON", "control character"]),  # a raw NUL byte
    (b'{"prompt":"a","max_tokens":4}\xff\xfe', ["not UTF-8", "0xff"]),
    (b'{"' + b"k" * 100_000 + b'":1}', ["unknown key", "(100002 characters)"]),  # error line stays short
    (b"\xef\xbb\xbf{}", ["invalid JSON"]),  # a BOM that is not at the start of the file
    (b"null", ["expected a JSON object, got null"]),
]


def test_every_hostile_line_is_one_error_row_and_the_rest_survive(tmp_path):
    good = [b'\xef\xbb\xbf{"prompt": "first, after a BOM"}',  # Windows editors start files with one
            b'{"prompt": "crlf line", "temperature": NaN}\r',  # NaN parses (SamplingParams refuses it later)
            '{"prompt": "NEL\u0085 and LINE SEPARATOR\u2028 inside"}'.encode(),
            b'{"prompt_token_ids": [4, 5]}']
    lines = [good[0], b"", *[line for line, _ in HOSTILE_LINES[:5]], b"  \t", good[1], *[
        line for line, _ in HOSTILE_LINES[5:]], "\u3000".encode(), good[2], good[3]]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\r\n")
    requests = read_prompts(None, str(path))
    assert [r.index for r in requests] == list(range(len(lines)))  # blank lines: error rows, no index shifts
    blank = [r for r in requests if r.error is not None and "the line is blank" in r.error]
    blank_lines = [i + 1 for i, line in enumerate(lines) if not line.decode(errors="replace").strip()]
    assert [r.index + 1 for r in blank] == blank_lines
    assert all(r.error.startswith(f"prompts_file line {r.index + 1}: ") for r in blank)
    requests = [r for r in requests if r not in blank]
    ok = [r for r in requests if r.error is None]
    assert [r.prompt or r.prompt_token_ids for r in ok] == [
        "first, after a BOM", "crlf line", "NEL\u0085 and LINE SEPARATOR\u2028 inside", [4, 5]]
    assert ok[1].overrides["temperature"] != ok[1].overrides["temperature"]  # NaN, kept for the engine to refuse
    errors = [r for r in requests if r.error is not None]
    assert len(errors) == len(HOSTILE_LINES)
    line_numbers = [i + 1 for i, line in enumerate(lines) if any(line == h for h, _ in HOSTILE_LINES)]
    for request, (_, words), line_no in zip(errors, HOSTILE_LINES, line_numbers):
        assert request.error.startswith(f"prompts_file line {line_no}: "), request.error
        assert "\n" not in request.error and len(request.error) < 400, request.error
        assert all(w in request.error for w in words), (request.error, words)
        assert request.prompt is None and request.prompt_token_ids is None


def test_a_tokenizer_failure_fails_that_request_only():
    class Picky:
        """Fails on one text, as tokenizers do on input they can't handle."""
        chat_template = None

        def encode(self, text):
            if "boom" in text:
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, ...]]")
            return [ord(c) for c in text]

    requests = [PromptRequest(0, "ok", None, {}), PromptRequest(1, "boom", None, {}), PromptRequest(2, "hi", None, {})]
    tokenize(requests, Picky(), chat_template=True)
    assert [r.prompt_token_ids for r in requests] == [[111, 107], None, [104, 105]]
    assert requests[1].error.startswith("prompt could not be tokenized (TypeError: TextEncodeInput")
    # a lone surrogate never reaches the tokenizer (the fast tokenizers raise TypeError on one)
    [cli] = read_prompts(["a \ud800"], None)
    assert cli.error == "prompts[0]: 'prompt' is not valid Unicode: lone surrogate U+D800 at character 2"


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_the_file_read_in_blocks_splits_lines_as_the_whole_file_does(tmp_path, monkeypatch, block):
    """Lines cut by a block boundary (inside a CRLF, a multi-byte character, the byte order mark) are
    read as if the file were read at once; the byte-scan count equals the requests read."""
    import codecs
    import random

    from spmd_engine.job import prompts as prompts_module

    rng = random.Random(block)
    pieces = [b'{"prompt": "a\xc3\xa9"}', b"", b"  ", b"\xc2\xa0", b"\xff", b'{"prompt_token_ids": [1, 2]}', b"{bad"]
    ends = [b"\n", b"\r\n", b"\r"]
    data = codecs.BOM_UTF8 + b"".join(rng.choice(pieces) + rng.choice(ends) for _ in range(200)) + b'{"prompt": "z"}'
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    monkeypatch.setattr(prompts_module, "READ_BLOCK_BYTES", block)
    assert list(prompts_module._raw_lines(path)) == data[len(codecs.BOM_UTF8):].splitlines()
    requests = list(prompts_module.iter_jsonl(path))
    monkeypatch.setattr(prompts_module, "READ_BLOCK_BYTES", 1 << 20)
    assert requests == read_prompts(None, str(path))
    assert prompts_module.count_jsonl_requests(path) == len(requests)
