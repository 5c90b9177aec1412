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
llama.cpp's do) and equal greedy text for 16 tokens of a fixed prompt. The integer products
themselves equal an exact emulation of that quantization (float64) within 1e-5.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from gguf_files import RECIPES, write_and_close, write_model
from model_harness import Harness
from srt_lite import cpu_caps, cpu_kernels
from srt_lite.layers.cpu_linear import gguf as gguf_linear
from srt_lite.layers.cpu_linear.gguf import DOT_ROWS, PACK_ROWS, PACKED_ID, PACKED_TYPES, GGUFWeight
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.model_loader import gguf_types
from srt_lite.model_loader.default_model import ModelPathError, default_gguf_path
from srt_lite.model_loader.gguf_reader import GGUFError, GGUFFile
from srt_lite.server_args import ServerArgs

pytestmark = pytest.mark.cpu_caps


def _packs(name: str) -> bool:
    """Whether this CPU has a packed kernel for the type (the C++ ops' own answer)."""
    return cpu_kernels.load() and torch.ops.srt_lite_cpu.gguf_packs(gguf_types.BY_NAME[name].id)


def _packed_types(reason: str, also_skip: bool = False) -> list:
    return [pytest.param(n, marks=pytest.mark.skipif(also_skip or not _packs(n), reason=reason)) for n in PACKED_TYPES]


def _int8_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, k] rounded as the products quantize it, in float64: int8 with one scale
    (max |x| / 127) per `block` values."""
    rows, k = x.shape
    xb = x.view(rows, k // block, block).double()
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d).view(rows, k)


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


@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_blocks_dequantize_as_gguf_does(name):
    t = gguf_types.BY_NAME[name]
    raw = gguf_types.random_blocks(t, 24, 512, torch.Generator().manual_seed(1))
    want = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(t.id))).view(24, 512)
    assert torch.equal(gguf_types.dequantize(raw, t, 512), want.float())


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_gguf_linear_against_the_dequantized_product(name):
    """Dot products (up to DOT_ROWS rows) within int8 activation error; dequantized slabs
    (more rows) exact in fp32; a part split, a bias, and each row's result independent of
    the batch around it (bit for bit)."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(2)
    raw = gguf_types.random_blocks(t, 72, 512, g)
    w = gguf_types.dequantize(raw, t, 512).double()
    bias = torch.randn(72, generator=g)
    weight = GGUFWeight([(t, raw[:40]), (t, raw[40:])], 512)
    x = torch.randn(DOT_ROWS + 8, 512, generator=g)
    want = x.double() @ w.t() + bias.double()

    def rel(y: torch.Tensor, rows: int) -> float:
        return ((y.double() - want[:rows]).norm() / want[:rows].norm()).item()

    for rows in (1, 5, DOT_ROWS):
        assert rel(weight.forward(x[:rows], bias), rows) < 0.02
        assert rel(weight.forward(x[:rows].bfloat16(), bias), rows) < 0.03
    assert rel(weight.forward(x, bias), x.shape[0]) < 1e-6
    assert rel(weight.forward(x.bfloat16(), bias), x.shape[0]) < 0.02
    batch = weight.forward(x[:DOT_ROWS], bias)
    for r in (0, 3, DOT_ROWS - 1):
        assert torch.equal(weight.forward(x[r : r + 1], bias)[0], batch[r])


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_dot_products_equal_int8_activations_exactly(name):
    """The dot products are x rounded to int8 with one scale per 32 values (per 256 for the
    K-quants' super-blocks, on every CPU level), times the dequantized weight: an exact
    float64 emulation agrees within float32 rounding, at K with a tail of 64 weights."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(5)
    k = 576 if t.unit == 32 else 512
    raw = gguf_types.random_blocks(t, 48, k, g)
    x = torch.randn(3, k, generator=g)
    xq = _int8_activations(x, 256 if t.unit == 256 else 32)
    want = xq @ gguf_types.dequantize(raw, t, k).double().t()
    got = torch.ops.srt_lite_cpu.gguf_linear(x, [raw], [t.id], None, DOT_ROWS, False).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_bf16_products_are_the_fp32_sums_rounded(name):
    """The dot products write bf16 outputs themselves (bias added, then rounded): bit for bit
    the fp32 product of the same x plus the bias, rounded as a tensor's .to(bfloat16) rounds,
    for packed and unpacked parts and a part whose last task has fewer than 16 rows."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(6)
    k = 512
    raw = gguf_types.random_blocks(t, 56, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:56])], k)  # 24 rows: a task of 16, one of 8
    bias = torch.randn(56, generator=g).bfloat16()
    for rows in (1, 5, DOT_ROWS):
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            want = weight.forward(x.float(), None if b is None else b.float()).bfloat16()
            got = weight.forward(x, b)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (rows, b is None)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_packed_groups_keep_every_bit(name):
    """A repacked weight (16 rows interleaved) unpacks to the file's blocks exactly: its
    dequantization equals the blocks' bit for bit (the slab path reads it that way)."""
    t = gguf_types.BY_NAME[name]
    k = 512
    raw = gguf_types.random_blocks(t, 48, k, torch.Generator().manual_seed(7))
    packed = torch.ops.srt_lite_cpu.gguf_repack(raw, t.id, k)
    assert packed.shape[0] == 48 // PACK_ROWS
    assert torch.equal(torch.ops.srt_lite_cpu.gguf_dequantize(packed, t.id + PACKED_ID, k),
                       torch.ops.srt_lite_cpu.gguf_dequantize(raw, t.id, k))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.srt_lite_cpu.gguf_repack(raw[:40], t.id, k)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_packed_kernels_by_cpu_level():
    """The AVX2 and AVX-512 builds pack Q4_K, Q5_K, Q6_K and Q8_0 (vpdpbusd with VNNI, vpmaddubsw
    without); the portable build none."""
    want = set(PACKED_TYPES) if cpu_caps.get().level in ("avx2", "avx512") else set()
    assert {n for n in PACKED_TYPES if _packs(n)} == want


@pytest.mark.parametrize("name", _packed_types("no packed kernel for this type on this CPU"))
def test_packed_products_equal_int8_activations(name):
    """The packed products compute what the file's blocks do: an exact float64 emulation of
    the int8 activations within float32 rounding, every row count up to DOT_ROWS, each row's
    result the same alone as in its batch (bit for bit), beside an unpacked part."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(8)
    k = 512
    raw = gguf_types.random_blocks(t, 48, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:40])], k)
    assert weight.kernel_ids == [t.id + PACKED_ID, t.id]  # 8 rows are not a packed group
    block = 256 if t.unit == 256 else 32
    for rows in (1, 3, 4, 5, 8, 11, DOT_ROWS):  # the row tiles (4; 8 for Q6_K on AVX2) and their tails
        x = torch.randn(rows, k, generator=g)
        xq = _int8_activations(x, block)
        want = xq @ gguf_types.dequantize(raw[:40], t, k).double().t()
        got = weight.forward(x).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-5, rows
        for r in range(rows):
            assert torch.equal(weight.forward(x[r : r + 1])[0], weight.forward(x)[r])


@pytest.mark.parametrize("name", _packed_types("prompts take the packed products where the CPU packs the type and has no AMX",
                                                 also_skip=cpu_caps.get().amx_bf16))
def test_packed_weights_take_int8_products_for_prompts(name):
    """A weight whose parts are all packed runs prompts (more than DOT_ROWS rows) through the
    same int8 products as decode: the float64 emulation within float32 rounding, and each
    row the same as alone (bit for bit), where a mixed weight still takes the slabs."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(9)
    k, rows = 512, DOT_ROWS + 24
    raw = gguf_types.random_blocks(t, 48, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:48])], k)
    assert weight.all_packed and gguf_linear.dot_rows(True) > rows
    assert not GGUFWeight([(t, raw[:32]), (t, raw[32:40])], k).all_packed
    block = 256 if t.unit == 256 else 32
    x = torch.randn(rows, k, generator=g)
    xq = _int8_activations(x, block)
    want = xq @ gguf_types.dequantize(raw, t, k).double().t()
    got = weight.forward(x)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    for r in (0, DOT_ROWS, rows - 1):
        assert torch.equal(weight.forward(x[r : r + 1])[0], got[r])


def test_without_the_cpp_ops_slabs_go_through_f_linear(monkeypatch):
    """Without a C++ compiler, a GGUFWeight dequantizes with gguf's numpy reference and
    multiplies in float: the exact product of the dequantized weight."""
    monkeypatch.setattr(gguf_linear.cpu_kernels, "load", lambda: False)
    monkeypatch.setattr(gguf_types, "_kernels_built", lambda: False)
    g = torch.Generator().manual_seed(6)
    parts = [(gguf_types.BY_NAME[n], gguf_types.random_blocks(gguf_types.BY_NAME[n], 8, 256, g)) for n in ("Q4_K", "Q5_0")]
    weight = GGUFWeight(parts, 256)
    want = torch.cat([torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(t.id))).view(8, 256)
                      for t, raw in parts])
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(weight.dequantized(), want.float())
    assert torch.allclose(weight.forward(x), x @ want.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_gguf_linear_refuses_bad_parts():
    t = gguf_types.BY_NAME["Q4_K"]
    raw = gguf_types.random_blocks(t, 8, 512, torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 320), [raw[:, :180]], [t.id], None, 16, False)
    with pytest.raises(RuntimeError, match="must be uint8"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 512), [raw[:, :100]], [t.id], None, 16, False)
    with pytest.raises(RuntimeError, match="has no kernel"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 512), [raw], [10], None, 16, False)


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
    """GGUF products set themselves up alike at any prompt length, so the warm-up's first
    pass is one token a request and no full chunk follows; its KV is freed."""
    runner = _runner(files["Q4_K_M", "llama"], "float32")
    shapes = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda fb: shapes.append(fb.extend_seq_lens_cpu) or forward(fb))
    free = runner.token_to_kv_pool.available_size()
    runner.warmup(max_decode_batch=4, num_draft_tokens=0, prefill_chunk=200)
    assert shapes == [[1] * 4, [1], [1] * 2, [1] * 4]
    assert runner.token_to_kv_pool.available_size() == free


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
