"""GGUF files served from their own blocks (model_loader/gguf_*.py, layers/cpu_linear/gguf.py,
csrc/cpu_gguf_linear.cpp), tested on files built from random blocks (tests/helpers/gguf_files.py)
and on the default model's own Q4_1 file, with gguf's numpy dequantization and transformers'
GGUF loader as the references.

Tolerances, stated once: the file's blocks dequantize bit for bit as gguf's; prompts of more
than DOT_ROWS tokens through dequantized slabs and a matmul give fp32 logits within 1e-4
(relative norm) of transformers' dequantized model; decode steps, and prompts on weights that
are all packed (AVX512-VNNI or AVX2, without AMX: see dot_rows), quantize activations to int8 per 32
values (per 256 for the K-quants), as llama.cpp does, and stay within 10% relative norm and mean KL < 0.01
on the random models (whose flat logits leave the top token to chance margins: 75% top-1 is
only a sanity bound there); on the default model's real weights, 90% teacher-forced top-1
agreement (measured: 92% in fp32, 97% in bf16; int8 activations flip near-ties, as
llama.cpp's do) and equal greedy text for 16 tokens of a fixed prompt. The products alone:
test_gguf_kernels.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

from gguf_files import RECIPES, write_and_close, write_model
from model_harness import Harness
from srt_lite.layers.cpu_linear import gguf as gguf_linear
from srt_lite.layers.cpu_linear.gguf import DOT_ROWS
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.model_loader.default_model import ModelPathError, default_gguf_path
from srt_lite.model_loader.gguf_reader import GGUFError, GGUFFile
from srt_lite.server_args import ServerArgs

pytestmark = pytest.mark.cpu_caps


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(recipe, arch) -> a tiny random model file; (recipe, arch, "weights") -> the same
    weights without the tokenizer, for transformers' reference."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for recipe, arch in [("Q4_K_M", "llama"), ("Q5_K_M", "llama"), ("Q6_K", "qwen2"), ("Q8_0", "qwen3"),
                         ("legacy", "llama")]:
        # Qwen3 with head_dim 128: transformers' GGUF config reader does not read key_length.
        heads = (2, 1) if arch == "qwen3" else (4, 2)
        for tokenizer in (True, False):
            name = f"{arch}-{recipe}{'' if tokenizer else '-weights'}.gguf"
            path = write_model(str(root / name), recipe, arch, heads=heads[0], kv_heads=heads[1],
                               tied=recipe == "Q8_0", tokenizer=tokenizer)
            out[recipe, arch, *(() if tokenizer else ("weights",))] = path
    return out


def _runner(path: str, dtype: str, quantization: str | None = None) -> ModelRunner:
    args = ServerArgs(model_path=path, dtype=dtype, quantization=quantization, max_total_tokens=1024)
    return ModelRunner(ModelConfig.load(path), args)


def _reference_logits(path: str, ids: list[int], cache: pytest.Cache) -> torch.Tensor:
    """transformers' logits for `ids` on the dequantized weights of `path`, a file that
    write_model wrote without the tokenizer (parsing a 49k-token vocabulary is most of the
    time transformers takes over the whole file). Kept in pytest's cache under a hash of the
    file, the ids and transformers' version, since `make test`'s AVX2 leg asks again."""
    import hashlib

    import transformers
    from transformers import AutoModelForCausalLM

    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read() + repr((ids, transformers.__version__)).encode()).hexdigest()[:24]
    saved = cache.mkdir("gguf_reference_logits") / f"{digest}.pt"
    if saved.exists():
        return torch.load(saved)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    torch.save(logits, saved)
    return logits


def _decode_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits after each prefix of `ids`, one token a step (the decode path)."""
    h = Harness(runner)
    out = [h.prefill([ids[:1]]).next_token_logits[0]]
    for t in ids[1:]:
        out.append(h.decode([t])[0])
    return torch.stack(out).float()


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    rel = ((got - want).norm() / want.norm()).item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return rel, kl, top1


@pytest.mark.parametrize("key", [("Q4_K_M", "llama"), ("Q5_K_M", "llama"), ("Q6_K", "qwen2"), ("Q8_0", "qwen3"),
                                 ("legacy", "llama")])
def test_tiny_model_matches_transformers(files, key, request):
    """The file loads with no float copy of a quantized weight; its logits match transformers'
    dequantized model: exactly loaded (--quantization none), prompts through dequantized
    slabs, and decode steps through the int8 dot products (fp32 and bf16)."""
    path = files[key]
    ids = torch.randint(0, 49152, (DOT_ROWS + 24,), generator=torch.Generator().manual_seed(4)).tolist()
    want = _reference_logits(files[(*key, "weights")], ids, request.config.cache)
    runner = _runner(path, "float32")
    kept = [m for m in runner.model.modules() if getattr(m, "gguf", None) is not None]
    linears = [m for m in runner.model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.gguf is not None and m.weight.numel() == 0 for m in linears)
    assert runner.model.model.embed_tokens.gguf is not None and runner.model.lm_head.gguf is not None
    assert sum(m.gguf.nbytes for m in kept) <= os.path.getsize(path)
    recipe = dict(RECIPES[key[0]])
    if key[0] == "Q8_0":
        del recipe["output"]  # tied to the embedding
    assert {t.name for m in kept for t in m.gguf.types} == set(recipe.values())
    prompt = Harness(runner).prefill([ids]).all_logits.float()
    if any(gguf_linear.dot_rows(m.gguf.all_packed) > DOT_ROWS for m in kept):  # int8 activations
        rel, kl, top1 = _compare(prompt, want)
        assert rel < 0.1 and kl < 0.01 and top1 >= 0.75, (rel, kl, top1)
    else:
        assert _compare(prompt, want)[0] < 1e-4
    dense = Harness(_runner(path, "float32", "none")).prefill([ids]).all_logits.float()
    assert _compare(dense, want)[0] < 1e-4
    for dtype in ("float32", "bfloat16"):
        rel, kl, top1 = _compare(_decode_logits(_runner(path, dtype), ids[:24]), want[:24])
        assert rel < 0.1 and kl < 0.01 and top1 >= 0.75, (dtype, rel, kl, top1)


def test_formats_are_named(files):
    runner = _runner(files["Q4_K_M", "llama"], "float32")
    formats = runner.gguf_formats
    assert formats == {"Q4_K": 4, "Q4_K+Q6_K": 2, "Q6_K": 4}  # o, gate/up; qkv; down, embedding, head


def test_warmup_of_a_gguf_model_runs_one_token_prompts(files, monkeypatch):
    """GGUF products set themselves up alike at any prompt length and row count, so the
    warm-up's first pass is one token a request, no full chunk follows and its batches stop
    at 4 rows; its KV is freed."""
    runner = _runner(files["Q4_K_M", "llama"], "float32")
    shapes = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda fb: shapes.append(fb.extend_seq_lens_cpu) or forward(fb))
    free = runner.token_to_kv_pool.available_size()
    for max_batch in (4, 32):
        shapes.clear()
        runner.warmup(max_decode_batch=max_batch, num_draft_tokens=0, prefill_chunk=200)
        assert shapes == [[1] * 4, [1], [1] * 2, [1] * 4]
        assert runner.token_to_kv_pool.available_size() == free
    shapes.clear()
    runner.warmup(max_decode_batch=2, num_draft_tokens=0, prefill_chunk=200)
    assert shapes == [[1] * 2, [1], [1] * 2]


def test_default_model_file_greedy_text(tokenizer):
    """The default model's own Q4_1 file, served from its blocks, against the same weights
    dequantized, fp32, greedy: teacher-forced next-token agreement over a fixed text, and the
    greedy continuation of a fixed prompt equal for its first 16 tokens."""
    path = default_gguf_path()
    native, plain = _runner(path, "float32"), _runner(path, "float32", "none")
    assert all(m.gguf is not None for m in native.model.modules() if isinstance(m, PackableLinear))
    text = ("The river runs past the old mill, where children gather in the summer to watch the water turn "
            "the wheel. Their grandparents remember when the mill still ground flour for the whole valley.")
    ids = tokenizer.encode(text)
    rel, kl, top1 = _compare(_decode_logits(native, ids), _decode_logits(plain, ids))
    assert rel < 0.05 and kl < 0.01 and top1 >= 0.9, (rel, kl, top1)

    def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
        h = Harness(runner)
        tok = int(h.prefill([prompt]).next_token_logits[0].argmax())
        out = [tok]
        for _ in range(n - 1):
            tok = int(h.decode([tok])[0].argmax())
            out.append(tok)
        return out

    prompt = tokenizer.encode("Once upon a time, in a small village,")
    assert greedy(native, prompt, 16) == greedy(plain, prompt, 16)


def test_metadata_reads_as_ggufs_own_reader_does():
    """The default model's metadata as gguf's reader gives it: scalars, numeric arrays, and the
    vocabulary and merges, which the reader steps over and decodes only when read."""
    import gguf

    ours, theirs = GGUFFile(default_gguf_path()), gguf.GGUFReader(default_gguf_path())
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.get(key)
        assert len(got) == len(want) and list(got) == want if isinstance(want, list) else got == want, key
    tokens = ours.get("tokenizer.ggml.tokens")
    assert len(tokens) > 40000 and tokens[0] == theirs.fields["tokenizer.ggml.tokens"].contents(0)


def test_unsupported_files_fail_in_one_line(tmp_path):
    from gguf import GGUFWriter

    bad_arch = tmp_path / "bad-arch.gguf"
    w = GGUFWriter(str(bad_arch), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    write_and_close(w)
    with pytest.raises(ModelPathError, match="architecture 'mamba' is not supported"):
        ModelConfig.load(str(bad_arch))
    bad_type = tmp_path / "bad-type.gguf"
    w = GGUFWriter(str(bad_type), "llama")
    w.add_tensor("blk.0.attn_q.weight", torch.zeros(4, 84, dtype=torch.uint8).numpy(),
                 raw_dtype=GGMLQuantizationType.Q2_K)
    write_and_close(w)
    with pytest.raises(GGUFError, match=r"tensor type Q2_K \(tensor blk.0.attn_q.weight\) is not supported"):
        GGUFFile(str(bad_type))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(default_gguf_path(), "rb").read()[:4_000_000])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(str(truncated))
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelPathError, match="not a GGUF file"):
        ModelConfig.load(str(not_gguf))


@pytest.mark.parametrize("key", [("Q4_K_M", "llama"), ("Q5_K_M", "llama"), ("Q6_K", "qwen2"), ("Q8_0", "qwen3")])
def test_launch_server_serves_the_file(files, key):
    """`python -m srt_lite.launch_server --model-path X.gguf` for each quantization users
    download: completions and chat (the file's own template), the blocks kept (no float copy
    of a quantized weight: the weights held are at most the file's bytes)."""
    import httpx

    from server_utils import ServerProcess

    path = files[key]
    with ServerProcess("--model-path", path, "--max-total-tokens", "2048") as s:
        info = httpx.get(s.base_url + "/server_info", timeout=10).json()
        assert info["gguf_formats"] and 0 < info["weight_bytes"] <= os.path.getsize(path), info
        assert {f for fmt in info["gguf_formats"] for f in fmt.split("+")} == set(RECIPES[key[0]].values())
        name = httpx.get(s.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(s.base_url + "/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 8,
                                                              "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
