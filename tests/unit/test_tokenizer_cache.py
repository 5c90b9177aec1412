"""The scheduler's and detokenizer's tokenizer without transformers
(srt_lite/model_loader/tokenizer_cache.py): the pipeline transformers built is cached and
decodes and encodes exactly as transformers does, including a tokenizer class that rebuilds
the pipeline of its tokenizer.json; a tokenizer whose decode transformers post-processes is
not cached."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from srt_lite.model_loader import tokenizer_cache
from srt_lite.model_loader.tokenizer_cache import CachedTokenizer

TEXTS = ["<think>", "</think>", "Hello, world!", " naïve café ☕ 東京", "a\n\n  b\tc", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path / "cache"))


def copy_tokenizer(src: str, dst, tokenizer_class: str | None = None) -> str:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.isfile(f"{src}/{name}"):
            shutil.copy(f"{src}/{name}", dst / name)
    if tokenizer_class:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = tokenizer_class
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return str(dst)


def assert_same(ours, theirs, vocab: int, specials: list[int]) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            ), (ids, skip)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("tokenizer_class", [None, "Qwen2Tokenizer"])
def test_cached_pipeline_decodes_and_encodes_as_transformers(default_model_dir, tmp_path, tokenizer_class):
    model_dir = copy_tokenizer(default_model_dir, tmp_path / "model", tokenizer_class)
    assert tokenizer_cache.cache_path(model_dir) is not None
    theirs = tokenizer_cache.load(model_dir)  # no cache yet: transformers', which it caches
    assert not isinstance(theirs, CachedTokenizer)
    ours = tokenizer_cache.load(model_dir)
    assert isinstance(ours, CachedTokenizer)
    assert_same(ours, theirs, len(theirs), theirs.all_special_ids)
    raw = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    # Qwen2's class rebuilds the pre-tokenizer: the file alone would not be transformers' pipeline.
    assert (raw.to_str() == theirs.backend_tokenizer.to_str()) == (tokenizer_class is None)
    assert ours.backend.to_str() == theirs.backend_tokenizer.to_str()


def test_changed_tokenizer_files_are_a_new_entry(default_model_dir, tmp_path):
    model_dir = copy_tokenizer(default_model_dir, tmp_path / "model")
    before = tokenizer_cache.cache_path(model_dir)
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert tokenizer_cache.cache_path(model_dir) != before
    assert tokenizer_cache.cache_path(str(tmp_path)) is None  # no tokenizer.json: never cached


def test_a_wordlevel_tokenizer_is_not_cached(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ",": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer_cache.save(AutoTokenizer.from_pretrained(tmp_path), str(tmp_path))
    assert not os.path.exists(tokenizer_cache.cache_path(str(tmp_path)))
    assert not isinstance(tokenizer_cache.load(str(tmp_path)), CachedTokenizer)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|> naïve ☕"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("tokenizer_class", [None, "Qwen2Tokenizer"])
def test_http_process_tokenizer_is_the_plain_one_where_that_is_the_same(default_model_dir, tmp_path, tokenizer_class):
    """After the first load, the HTTP process's tokenizer is transformers' plain fast
    tokenizer over the cached pipeline (no AutoTokenizer, which imports torch), with every
    attribute and answer of the class transformers picked."""
    model_dir = copy_tokenizer(default_model_dir, tmp_path / "model", tokenizer_class)
    theirs = tokenizer_cache.load_transformers(model_dir)
    ours = tokenizer_cache.load_transformers(model_dir)
    assert type(ours) is PreTrainedTokenizerFast
    assert (type(theirs) is PreTrainedTokenizerFast) == (tokenizer_class is None)
    skip = tokenizer_cache.UNCOMPARED
    assert {k: repr(v) for k, v in vars(ours).items() if k not in skip} == {
        k: repr(v) for k, v in vars(theirs).items() if k not in skip}
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert_same(ours, theirs, len(theirs), theirs.all_special_ids)
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
        ids = theirs.encode(text)
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    for gen in (True, False):
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == theirs.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=gen)
    assert ours.get_vocab() == theirs.get_vocab() and ours.special_tokens_map == theirs.special_tokens_map


class _OwnDecode(PreTrainedTokenizerFast):
    """A tokenizer class with behaviour of its own: no attribute copy can stand in for it."""

    def decode(self, *args, **kwargs):
        return super().decode(*args, **kwargs).upper()


def test_a_class_with_methods_of_its_own_is_not_cached(default_model_dir, tmp_path):
    model_dir = copy_tokenizer(default_model_dir, tmp_path / "model")
    own = _OwnDecode.from_pretrained(model_dir)
    assert tokenizer_cache.has_own_methods(own) and not tokenizer_cache.has_own_methods(AutoTokenizer.from_pretrained(model_dir))
    tokenizer_cache.save(own, model_dir)
    assert not os.path.exists(tokenizer_cache.cache_path(model_dir))


def test_attributes_the_record_cannot_hold_keep_autotokenizer(default_model_dir, tmp_path, monkeypatch):
    model_dir = copy_tokenizer(default_model_dir, tmp_path / "model")
    theirs = AutoTokenizer.from_pretrained(model_dir)
    theirs.model_input_names = ["input_ids"]  # a list differing from the plain tokenizer's
    tokenizer_cache.save(theirs, model_dir)
    path = tokenizer_cache.cache_path(model_dir)
    assert os.path.isfile(path)  # the children still decode from the pipeline
    assert json.loads(open(tokenizer_cache.plain_record_path(path)).read()) == {"overrides": None}
    monkeypatch.setattr(tokenizer_cache, "load_plain", lambda *a: pytest.fail("the plain tokenizer was used"))
    assert tokenizer_cache.load_transformers(model_dir).model_input_names == ["input_ids", "attention_mask"]
