"""The C++ CPU ops (srt_lite/csrc/*.cpp) in a model: the token cascade and the prompt attention
match the torch ops' logits, the compiled graph's packed linear gives their result bit for bit,
the ops are chosen where they compute and built once per level, the elementwise ops round as
torch's, and bad input raises. Built for this CPU's level (cpu_caps); `make test` runs this
module again with the level capped at AVX2. The ops alone: test_cpu_linear_kernels.py,
test_cpu_panel_kernels.py, test_cpu_attention_kernels.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model_harness import Harness, fragment_free_list
from srt_lite import cpu_caps
from srt_lite import cpu_kernels
from srt_lite.layers.attention.torch_native.choose import PlanKind, cpp_cascade_ok
from srt_lite.layers.attention.torch_native.steps import CppCascadePlan
from srt_lite.layers.cpu_linear.paths import PATH_PACKED
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.layers.cpu_linear.products import packed_linear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.server_args import ServerArgs
from tiny_models import make_tiny_model


pytestmark = pytest.mark.cpu_caps

# oneDNN packs bf16 weights only where it computes bf16 (AVX-512, AVX-NE-CONVERT, ARM BF16);
# fp32 weights it packs everywhere, so the packed-op tests use those on other CPUs.
PACK_DTYPE = torch.bfloat16 if cpu_caps.get().onednn_bf16 else torch.float32


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load()  # CI's machine has the C++ compiler inductor's wrapper uses


@pytest.mark.parametrize("consecutive,dtype", [(True, "bfloat16"), (False, "bfloat16"), (True, "float32")])
def test_token_cascade_op_matches_the_torch_ops_logits(tmp_path, consecutive, dtype):
    """Packed model (token axis padded to the row bucket): rows of 1, 4, 9 and 24 new tokens
    over a shared 80-token prefix, then decode steps, once through the C++ op and once through
    torch ops; the prefix is a view of the pool or gathered (scattered slots). The C++ op
    attends the suffixes in fp32 without a mask and rounds once, so bf16 agrees to bf16's
    rounding of the attention output and fp32 to float rounding."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    backend = runner.attn_backend
    assert backend.cpu_kernels and runner.pad_rows == (runner.linear_path == PATH_PACKED)
    if not consecutive:
        fragment_free_list(runner, 1)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 320, (80,), generator=g).tolist()
    suffixes = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 4, 9, 24)]
    h = Harness(runner)
    h.prefill([prefix])

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        rows = h.rows_sharing_prefix(len(suffixes), 80)
        hr = Harness(runner)
        out = [hr.extend(rows, [80] * 4, suffixes, all_logits=False).next_token_logits]
        hr.rows, hr.lens = rows, [80 + len(s) for s in suffixes]
        for _ in range(3):
            out.append(hr.decode(out[-1].argmax(-1).tolist()))
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (1e-2 if dtype == "bfloat16" else 1e-5), err
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_that_share_nothing_attend_their_own_keys_in_the_cpp_op(tmp_path, dtype):
    """Prompts of different lengths with no common prefix, then decode steps and a verify
    step: with the C++ op each step is one CPP_CASCADE without a prefix part, and its logits
    agree with the torch ops' (padded decode and folded plans)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 50, 7, 90)]
    drafts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 5, 1, 2)]

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        h = Harness(runner)
        out = [h.prefill(prompts).next_token_logits]
        seen.clear()
        for _ in range(3):
            out.append(h.decode(out[-1].argmax(-1).tolist()))
        out.append(h.extend(h.rows, list(h.lens), drafts, all_logits=True).all_logits)
        kinds = {(grp.plan.kind, grp.plan.shared_prefix_len) for step in seen for grp in step.groups}
        assert kinds == ({(PlanKind.CPP_CASCADE, 0)} if cpp else {(PlanKind.DECODE, 0), (PlanKind.FOLDED, 0)})
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (1e-2 if dtype == "bfloat16" else 1e-5), err
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_linear_op_equals_the_python_product():
    torch.manual_seed(0)
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(96, 64, dtype=PACK_DTYPE), requires_grad=False)
    layer.pack_for_cpu()
    bias = torch.randn(96, dtype=PACK_DTYPE)
    for n in (1, 5, 16, 48):
        x = torch.randn(n, 64, dtype=PACK_DTYPE)
        for b in (None, bias):
            got = torch.ops.srt_lite_cpu.packed_linear(x, b, layer.cpp_key)
            assert got.shape == (n, 96)
            assert torch.equal(got, packed_linear(x, layer.packed_weight, b))


def test_a_freed_weight_or_unknown_key_raises_instead_of_crashing():
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(8, 8, dtype=PACK_DTYPE), requires_grad=False)
    layer.pack_for_cpu()
    key = layer.cpp_key
    x = torch.randn(2, 8, dtype=PACK_DTYPE)
    del layer  # the op holds the packed weight weakly
    with pytest.raises(RuntimeError, match="freed"):
        torch.ops.srt_lite_cpu.packed_linear(x, None, key)
    with pytest.raises(RuntimeError, match="no packed weight"):
        torch.ops.srt_lite_cpu.packed_linear(x, None, 10**6)


def test_cascade_step_is_set_once_per_forward_and_belongs_to_its_thread():
    """The compiled graph's attention op finds its step where set_cascade_step left it. A step
    set over one not cleared is refused (it would attend the wrong rows), and another
    thread's forward does not see it."""
    import threading

    ids = torch.zeros(1, dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    step = (ids, ids, offsets, offsets, 0, 0, ids, 1, 1.0, [], [])
    torch.ops.srt_lite_cpu.set_cascade_step(*step)
    try:
        with pytest.raises(RuntimeError, match="not cleared"):
            torch.ops.srt_lite_cpu.set_cascade_step(*step)
        elsewhere = []  # another thread sets its own step while this one is set

        def other_forward():
            torch.ops.srt_lite_cpu.set_cascade_step(*step)
            torch.ops.srt_lite_cpu.clear_cascade_step()
            elsewhere.append(True)

        thread = threading.Thread(target=other_forward)
        thread.start()
        thread.join()
        assert elsewhere == [True]
    finally:
        torch.ops.srt_lite_cpu.clear_cascade_step()
    torch.ops.srt_lite_cpu.set_cascade_step(*step)
    torch.ops.srt_lite_cpu.clear_cascade_step()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prompts_and_chunks_take_the_prompt_op_with_the_torch_ops_logits(tmp_path, dtype):
    """Prompts of several lengths in one step, then a chunk of each after its cached part:
    with the C++ ops every such step is one CPP_PROMPT group, and its logits (every
    position's) agree with the torch ops' (padded SDPA under a mask)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    fragment_free_list(runner, seed=3)
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (130, 50, 33, 90)]
    chunks = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 70, 33, 100)]

    backend.amx = False  # with AMX bf16 prompts take the flash kernel (test_attention_plans)

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        seen.clear()
        h = Harness(runner)
        out = [h.prefill(prompts).all_logits]
        out.append(h.extend(h.rows, list(h.lens), chunks, all_logits=True).all_logits)
        kinds = {grp.plan.kind for step in seen for grp in step.groups}
        assert kinds == ({PlanKind.CPP_PROMPT} if cpp else {PlanKind.EXTEND})
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (2e-2 if dtype == "bfloat16" else 1e-5), err
        if dtype == "float32":
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_disabled_by_environment():
    env = dict(os.environ, SRT_LITE_DISABLE_CPU_KERNELS="1")
    code = "from srt_lite import cpu_kernels; print(cpu_kernels.load())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "own,new_tokens,torch_kind",
    [
        # 8 decode rows with 6 own tokens each: one masked suffix sequence has ~8x the pairs
        # of padding each row, so torch's path pads row by row.
        ((6,) * 8, 1, PlanKind.CASCADE),
        # 4 rows of 16 new tokens over 120-150 own tokens each: the masked sequence (~38.6K
        # pairs) is under 4x the padded ones, so torch's path takes it.
        ((140, 130, 120, 150), 16, PlanKind.TOKEN_CASCADE),
    ],
)
def test_token_cascade_choice_with_and_without_the_cpp_op(tmp_path, own, new_tokens, torch_kind):
    """Rows over an 80-token shared prefix: the step's single group is the C++ token cascade
    with the op, and as torch's rule says without it; the logits agree either way (fp32)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=4096))
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(3, 320, (80,), generator=g).tolist()
    h = Harness(runner)
    h.prefill([prefix])
    rows = h.rows_sharing_prefix(len(own), 80)
    own_ids = [torch.randint(3, 320, (n,), generator=g).tolist() for n in own]
    hr = Harness(runner)
    hr.extend(rows, [80] * len(own), own_ids, all_logits=False)
    new = [torch.randint(3, 320, (new_tokens,), generator=g).tolist() for _ in rows]
    logits = {}
    for cpp in (False, True):
        backend.cpu_kernels = cpp
        seen.clear()
        logits[cpp] = hr.extend(rows, [80 + n for n in own], new, all_logits=True).all_logits
        (group,) = seen[0].groups
        want = PlanKind.CPP_CASCADE if cpp else torch_kind
        assert group.plan.shared_prefix_len == 80 and group.plan.kind is want
    assert torch.allclose(logits[False], logits[True], atol=1e-5)


@pytest.mark.slow
def test_compiled_graph_runs_a_token_cascade_step_in_cpp_and_other_steps_in_python(tmp_path, monkeypatch):
    """--enable-torch-compile: a step that is one token cascade runs its attention inside the
    graph's C++ op (no Python call per layer); the steps around it (prefill, plain decode) go
    through the Python op. Logits agree with the eager runner's."""
    python_calls = []
    original = CppCascadePlan.run
    monkeypatch.setattr(CppCascadePlan, "run", lambda *a: python_calls.append(1) or original(*a))
    monkeypatch.setenv("SRT_LITE_DISABLE_CPP_DECODER", "1")  # eager: the Python layers, counted
    path = make_tiny_model("llama", tmp_path / "llama")

    def run(compile_: bool) -> list[torch.Tensor]:
        args = ServerArgs(dtype="bfloat16", max_total_tokens=4096, enable_torch_compile=compile_)
        runner = ModelRunner(ModelConfig.load(path), args)
        if compile_:
            runner.warmup(max_decode_batch=2, num_draft_tokens=2, prefill_chunk=0)
        g = torch.Generator().manual_seed(8)
        prefix = torch.randint(3, 320, (80,), generator=g).tolist()
        h = Harness(runner)
        outs = [h.prefill([prefix]).next_token_logits]
        rows = h.rows_sharing_prefix(3, 80)
        hr = Harness(runner)
        suffixes = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (2, 5, 7)]
        python_calls.clear()
        outs.append(hr.extend(rows, [80] * 3, suffixes, all_logits=False).next_token_logits)  # a token cascade
        cascade_python_calls = len(python_calls)
        outs.append(Harness(runner).prefill([suffixes[2]]).next_token_logits)  # no shared prefix
        return outs, cascade_python_calls

    (eager, eager_calls), (compiled, compiled_calls) = run(False), run(True)
    assert eager_calls == 2 and compiled_calls == 0  # 2 layers through Python, or none
    for a, b in zip(eager, compiled):
        assert (a.float() - b.float()).abs().max().item() < 0.1
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_cascade_op_only_for_the_dtypes_and_head_sizes_it_computes():
    """Other models keep the torch-ops cascade instead of failing the C++ op's checks."""
    assert cpp_cascade_ok(True, torch.bfloat16, 64) and cpp_cascade_ok(True, torch.float32, 128)
    assert not cpp_cascade_ok(True, torch.float16, 64)
    assert not cpp_cascade_ok(True, torch.bfloat16, 72) and not cpp_cascade_ok(True, torch.bfloat16, 512)
    assert not cpp_cascade_ok(False, torch.bfloat16, 64)  # not built (or turned off)


def test_compiled_graphs_are_cached_per_build_of_the_ops(monkeypatch, tmp_path):
    """A graph compiled against another build of the ops is never loaded: inductor's cache
    folder is named by this build (torch, CPU level, sources); a folder the user chose wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    cpu_kernels.use_private_inductor_cache()
    tag = cpu_kernels.build_tag()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / tag)
    assert tag.startswith(f"torch{torch.__version__}-{cpu_caps.get().level}-")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cpu_kernels.use_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_a_finished_build_loads_without_cpp_extension(monkeypatch):
    """A build folder that holds this build's library is loaded as it is (cpp_extension, with
    its setuptools import and ninja run, is not needed), and other compiler flags name
    another folder, so that a change of flags never loads the old library."""
    code = "import sys; sys.modules['torch.utils.cpp_extension'] = None\nfrom srt_lite import cpu_kernels\nprint(cpu_kernels.load())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "True", r.stderr[-2000:]
    tag = cpu_kernels.build_tag()
    level = cpu_caps.get().level
    monkeypatch.setitem(cpu_kernels.VEC_FLAGS, level, [*cpu_kernels.VEC_FLAGS.get(level, []), "-DSRT_LITE_TEST_FLAG"])
    assert cpu_kernels.build_tag() != tag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_elementwise_ops_round_as_the_torch_ops(dtype, rows):
    """RMSNorm (with and without the residual add), RoPE and SiLU-and-mul in C++ against the
    torch ops they replace in RMSNorm, RotaryEmbedding and SiluAndMul. RoPE and SiLU round
    each step as torch does and agree bit for bit; the residual sum too; the norm sums its
    squares in another order, so its output may differ in the last places (in bf16 and
    fp16 rarely, where its rounding hides the factor's last bits)."""
    from srt_lite.layers.activation import SiluAndMul
    from srt_lite.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(rows)
    n = 200  # not a multiple of any vector width
    norm = RMSNorm(n, 1e-5).to(dtype)
    norm.weight.data = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    x, r = (torch.randn(rows, n, generator=g) * 3).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}[dtype]
    want_h = x + r
    got, got_h = torch.ops.srt_lite_cpu.add_rms_norm(x, r, norm.weight, 1e-5)
    assert torch.equal(got_h, want_h)
    for want, got in ((norm._norm(want_h), got), (norm._norm(x), torch.ops.srt_lite_cpu.rms_norm(x, norm.weight, 1e-5))):
        # within a few units of the last place of the row's largest value (the factor's
        # last bits move with the sum order, which differs with the vector width)
        row_max = want.float().abs().amax(-1, keepdim=True)
        assert ((want.float() - got.float()).abs() <= 4 * ulp * row_max).all()
        if dtype != torch.float32:  # in fp32 a factor one ulp apart moves most elements
            assert (want != got).float().mean() < 0.02
    heads, D = 5, 48
    qk = torch.randn(rows, heads + 2, D, generator=g).to(dtype)[:, :heads]  # heads of a wider row
    cos, sin = (torch.randn(rows, 1, D, generator=g).to(dtype) for _ in range(2))
    want = qk * cos + torch.cat((qk[..., D // 2:], qk[..., : D // 2]), dim=-1) * sin
    assert torch.equal(torch.ops.srt_lite_cpu.rope(qk, cos, sin), want)
    gate_up = (torch.randn(rows, 2 * 100, generator=g) * 4).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    assert torch.equal(torch.ops.srt_lite_cpu.silu_and_mul(gate_up), want)
    assert torch.equal(SiluAndMul()(gate_up), want)  # the layer takes the C++ op on CPU


def test_elementwise_ops_reject_bad_shapes():
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.srt_lite_cpu.rms_norm(torch.randn(2, 9), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.srt_lite_cpu.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="cos / sin"):
        torch.ops.srt_lite_cpu.rope(torch.randn(2, 3, 8), torch.randn(2, 1, 4), torch.randn(2, 1, 8))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.srt_lite_cpu.silu_and_mul(torch.randn(2, 7))
