"""Sampling parameters, seeds, logprobs and n > 1 through the whole engine."""

from __future__ import annotations

import torch

from engine_utils import chat_ids, wait_idle

PROMPT = "Once upon a time, in a small village,"


def test_seeded_request_is_reproducible_alone_and_in_a_batch(engine):
    seeded = {"max_new_tokens": 24, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    alone = engine.generate(PROMPT, seeded)["output_ids"]
    noisy = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    batch = engine.generate(
        ["The weather today", PROMPT, "In the beginning", "My favourite food"],
        [noisy, seeded, noisy, noisy],
    )
    assert batch[1]["output_ids"] == alone
    assert engine.generate(PROMPT, seeded)["output_ids"] == alone
    other_seed = engine.generate(PROMPT, {**seeded, "seed": 43})["output_ids"]
    assert other_seed != alone


def test_logit_bias_forces_and_forbids_per_request(engine):
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = engine.generate(PROMPT, greedy)["output_ids"]
    forced, forbidden, untouched = engine.generate(
        [PROMPT, PROMPT, PROMPT],
        [{**greedy, "logit_bias": {"1000": 100}}, {**greedy, "logit_bias": {str(base[0]): -100}}, greedy],
    )
    assert forced["output_ids"] == [1000] * 6
    assert base[0] not in forbidden["output_ids"]
    assert untouched["output_ids"] == base


def test_min_new_tokens_keeps_eos_away_and_ignore_eos_runs_to_max(engine, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    short = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 64, "temperature": 0})
    n = short["meta_info"]["completion_tokens"]
    assert short["meta_info"]["finish_reason"]["matched"] == 2 and n < 30
    longer = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 64, "temperature": 0, "min_new_tokens": n + 5})
    assert longer["meta_info"]["completion_tokens"] >= n + 5
    assert 2 not in longer["output_ids"][: n + 4]
    full = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 48, "temperature": 0, "ignore_eos": True})
    assert full["meta_info"]["completion_tokens"] == 48
    assert full["meta_info"]["finish_reason"]["type"] == "length"


def test_penalties_change_greedy_output(engine):
    greedy = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompt = "Repeat after me: la la la la la la"
    base = engine.generate(prompt, greedy)["output_ids"]
    penalised = engine.generate(prompt, {**greedy, "frequency_penalty": 2.0})["output_ids"]
    assert penalised != base
    # A strong frequency penalty spreads the output over more distinct tokens.
    assert len(set(penalised)) > len(set(base))
    assert engine.generate(prompt, {**greedy, "repetition_penalty": 1.5})["output_ids"] != base


def test_logprobs_match_transformers(engine, hf_model, tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    start = 3
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True, logprob_start_len=start, top_logprobs_num=3, token_ids_logprob=[11, 12],
    )
    meta = out["meta_info"]
    seq = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0].float(), -1)
    # prompt: one entry per position from logprob_start_len
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - start
    for k, (lp, tid, text) in enumerate(meta["input_token_logprobs"]):
        pos = start + k
        assert tid == seq[pos] and text is None
        assert abs(lp - ref[pos - 1, tid].item()) < 1e-3
    # output: the sampled token is the top-1 under greedy, values match transformers
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for k, ((lp, tid, _), top, by_id) in enumerate(
        zip(meta["output_token_logprobs"], meta["output_top_logprobs"], meta["output_token_ids_logprobs"])
    ):
        pos = len(ids) + k - 1
        assert top[0][1] == tid and len(top) == 3
        assert abs(lp - ref[pos, tid].item()) < 1e-3
        assert [t for _, t, _ in by_id] == [11, 12]
        assert abs(by_id[0][0] - ref[pos, 11].item()) < 1e-3


def test_prompt_logprobs_from_zero_and_text(engine):
    out = engine.generate(
        "Hello world, this is", {"max_new_tokens": 2, "temperature": 0},
        return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == meta["prompt_tokens"]
    assert entries[0][0] is None and all(e[0] <= 0 for e in entries[1:])
    assert "".join(e[2] for e in entries) == "Hello world, this is"


def test_n_completions_share_one_prefill(engine):
    prompt = "n > 1 test prompt: " + "a long shared prefix with many words in it " * 5
    assert engine.flush_cache()
    outs = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7, "ignore_eos": True})
    assert isinstance(outs, list) and len(outs) == 3
    n_prompt = outs[0]["meta_info"]["prompt_tokens"]
    assert all(o["meta_info"]["cached_tokens"] == n_prompt - 1 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # distinct samples
    again = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7, "ignore_eos": True})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert wait_idle(engine).invariant_ok
