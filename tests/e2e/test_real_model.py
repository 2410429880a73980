"""The real SmolLM2-135M-Instruct through `python run.py`: it knows Paris, token for token like HF."""
from __future__ import annotations

import pytest
import torch

from tests.e2e.engine_args import FRANCE
from tests.helpers.run_engine import read_metrics, read_outputs


@pytest.mark.slow
def test_france_prompt_says_paris_and_matches_hf_greedy(smollm2_single, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, job_dir = smollm2_single
    [row] = read_outputs(job_dir)
    assert row["error"] is None and row["finish_reason"] in ("stop", "length")
    assert "Paris" in row["text"] and "Paris" in run.stdout
    assert read_metrics(job_dir)["status"] == "ok"

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
    assert row["prompt_token_ids"] == prompt_ids
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    assert row["token_ids"] == out[0, len(prompt_ids):].tolist()
    assert row["text"] == tokenizer.decode(row["token_ids"], skip_special_tokens=True)
