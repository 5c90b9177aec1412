"""A GGUF's 4-bit linears served as they are stored (model_loader/gguf_quant.py and
PackableLinear.use_int4): the codes read back equal transformers' dequantization exactly,
and the model with its 4-bit decode products stays with the dequantized one in logits,
greedy tokens and the log-likelihood of a fixed text (bf16; fp32 runs dequantized). Also the AVX2 leg
(`cpu_caps`), where torch's int4 kernel takes its AVX2 path."""

from __future__ import annotations

import glob
import math

import pytest
import torch
from safetensors import safe_open

from model_harness import Harness
from srt_lite.layers.cpu_linear import packable
from srt_lite.layers.cpu_linear.paths import INT4_ROWS, int4_panel_rows, panels_built
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.model_loader import gguf_quant
from srt_lite.model_loader.default_model import default_gguf_path, source_gguf
from srt_lite.server_args import ServerArgs
from tiny_models import make_tiny_model

pytestmark = pytest.mark.cpu_caps

TEXT = (
    "The river runs past the old mill, where children gather in the summer to watch the "
    "water turn the wheel. Their grandparents remember when the mill still ground flour."
)


@pytest.fixture(scope="module")
def q4():
    return gguf_quant.read_q4_tensors(default_gguf_path())


def test_codes_dequantize_exactly_to_the_converted_checkpoint(q4, default_model_dir):
    """Every Q4_1 linear of the default GGUF (210: 7 per layer, 30 layers), q and k with
    llama.cpp's row permutation undone, equals the weight transformers dequantized."""
    assert len(q4) == 210
    (path,) = glob.glob(f"{default_model_dir}/*.safetensors")
    with safe_open(path, framework="pt") as f:
        for name, (codes, scale, zero) in q4.items():
            assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
            assert torch.equal(gguf_quant.dequantize(codes, scale, zero), f.get_tensor(name).float()), name


def test_cache_holds_what_the_gguf_holds(q4, tmp_path):
    """load_q4_tensors writes its cache on first use and reads the same tensors back."""
    first = gguf_quant.load_q4_tensors(str(tmp_path), default_gguf_path())
    assert (tmp_path / gguf_quant.CACHE_FILE).is_file()
    cached = gguf_quant.load_q4_tensors(str(tmp_path), default_gguf_path())
    for got in (first, cached):
        assert got.keys() == q4.keys()
        for name, want in q4.items():
            assert all(torch.equal(a, b) for a, b in zip(got[name], want)), name


def test_converted_checkpoint_records_its_gguf(default_model_dir):
    assert source_gguf(default_model_dir) == default_gguf_path()


def _runner(dtype: str, quantization: str | None) -> ModelRunner:
    args = ServerArgs(dtype=dtype, quantization=quantization, max_total_tokens=2048)
    return ModelRunner(ModelConfig.load(args.model_path or _default_dir()), args)


def _default_dir() -> str:
    from srt_lite.model_loader.default_model import resolve_model_path

    return resolve_model_path(None)


def _decode_logprobs(runner: ModelRunner, ids: list[int]) -> tuple[list[torch.Tensor], float]:
    """One token a step (the single-stream decode the 4-bit path serves): the logits after
    each prefix of `ids` and the log-likelihood of ids[1:]."""
    h = Harness(runner)
    logits = [h.prefill([ids[:1]]).next_token_logits[0]]
    for t in ids[1:-1]:
        logits.append(h.decode([t])[0])
    ll = sum(torch.log_softmax(lg.float(), -1)[t].item() for lg, t in zip(logits, ids[1:]))
    return logits, ll


def test_int4_decode_stays_with_the_dequantized_model(tokenizer):
    int4, plain = _runner("bfloat16", None), _runner("bfloat16", "none")
    linears = [m for m in int4.model.modules() if isinstance(m, PackableLinear)]
    assert int4.int4_linears == 120 and all(m.int4 is not None for m in linears)  # 4 fused linears x 30
    assert plain.int4_linears == 0
    ids = tokenizer.encode(TEXT)
    got, ll_int4 = _decode_logprobs(int4, ids)
    want, ll_plain = _decode_logprobs(plain, ids)
    # Logits: the same weights through another kernel, its scales rounded to bf16.
    for a, b in zip(got, want):
        assert ((a - b).abs().max() / b.abs().max()).item() < 0.05
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(got, want)) / len(got)
    assert agree >= 0.9, agree
    # The log-likelihood against the dequantized model's exact one (fp32): bf16's own
    # rounding moves it by up to ~0.02 a token depending on the kernel's summation, so the
    # 4-bit path gets twice that.
    _, ll_exact = _decode_logprobs(_runner("float32", "none"), ids)
    per_token = abs(ll_int4 - ll_exact) / (len(ids) - 1)
    assert per_token < 0.04, (ll_int4, ll_exact, ll_plain)
    assert abs(ll_plain - ll_exact) / (len(ids) - 1) < 0.02, (ll_plain, ll_exact)
    assert math.isfinite(ll_int4)


def test_fp32_runs_the_dequantized_checkpoint_exactly(tokenizer):
    """torch's int4 kernel has no fast fp32 path: an fp32 model keeps the plain weights, and
    its logits are bit for bit those of --quantization none."""
    a, b = _runner("float32", None), _runner("float32", "none")
    assert a.int4_linears == 0
    ids = tokenizer.encode(TEXT)[:12]
    assert all(torch.equal(x, y) for x, y in zip(_decode_logprobs(a, ids)[0], _decode_logprobs(b, ids)[0]))


def test_int4_only_for_few_rows_and_the_full_weight_beyond(tokenizer, monkeypatch):
    """Prefill (many rows) runs the full-precision weight, so it equals the dequantized model
    bit for bit; steps of up to INT4_ROWS rows call torch's int4 kernel, and where the weights
    are in bf16 panels (AVX512-BF16 or AMX), steps of up to int4_panel_rows() the 4-bit panels."""
    int4, plain = _runner("bfloat16", None), _runner("bfloat16", "none")
    ids = tokenizer.encode(TEXT + " " + TEXT)
    assert len(ids) > int4_panel_rows()
    a = Harness(int4).prefill([ids]).all_logits
    b = Harness(plain).prefill([ids]).all_logits
    assert torch.equal(a, b)
    layer = next(m for m in int4.model.modules() if isinstance(m, PackableLinear))
    assert (layer.int4_panels is not None) == panels_built()
    x = torch.randn(int4_panel_rows() + 1, layer.weight_shape[1], dtype=torch.bfloat16)
    calls, panel_calls = [], []
    original, panel_original = packable.int4_linear, packable.int4_panel_linear
    monkeypatch.setattr(packable, "int4_linear", lambda *args: calls.append(args[0].shape[0]) or original(*args))
    monkeypatch.setattr(packable, "int4_panel_linear",
                        lambda *args: panel_calls.append(args[0].shape[0]) or panel_original(*args))
    for rows in range(1, int4_panel_rows() + 2):
        layer.matmul(x[:rows], None)
    assert calls == list(range(1, INT4_ROWS + 1))
    assert panel_calls == (list(range(INT4_ROWS + 1, int4_panel_rows() + 1)) if panels_built() else [])


@pytest.mark.skipif(not panels_built(), reason="the 4-bit panels need AVX512-BF16")
def test_int4_panels_decode_batches_with_the_dequantized_model(tokenizer):
    """Batched decode steps (8 rows) through the 4-bit panels (on AMX tiles where the CPU has
    them) stay with the dequantized model: logits within a few percent, greedy tokens agreeing."""
    int4, plain = _runner("bfloat16", None), _runner("bfloat16", "none")
    ids = tokenizer.encode(TEXT)
    prompts = [ids[i:i + 6] for i in range(8)]
    got, want = Harness(int4), Harness(plain)
    a, b = got.prefill(prompts).next_token_logits, want.prefill(prompts).next_token_logits
    agree = total = 0
    for step in range(6):
        nxt = [ids[i + 6 + step] for i in range(8)]  # teacher-forced: the text's next tokens
        a, b = got.decode(nxt), want.decode(nxt)
        for x, y in zip(a, b):
            assert ((x.float() - y.float()).abs().max() / y.float().abs().max()).item() < 0.05
            agree += int(x.argmax() == y.argmax())
            total += 1
    assert agree / total >= 0.9, (agree, total)


def test_hf_checkpoint_has_no_int4_and_gguf_mode_refuses_it(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=256))
    assert runner.int4_linears == 0
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf"):
        ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", quantization="gguf", max_total_tokens=256))
