"""Triton fused MoE vs the plain-torch reference: CPU under the Triton interpreter at tiny shapes
(both paths, expert parallelism, repeated experts), and (marked gpu) bf16 at the real shapes."""

import functools
import importlib.util
import os

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU tests' kernels are interpreted

import pytest  # noqa: E402
import torch  # noqa: E402

from deltaserve.layers.kernels.moe import naive  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def kernel_env(request, monkeypatch):
    """torch.empty hands out NaN-filled memory, so an output element a kernel never writes fails;
    the interpreter switch is on while a CPU test runs (its kernels check it when called)."""
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    torch.use_deterministic_algorithms(det)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def kernel_module(*, interpret: bool):
    """A private copy of the Triton kernel module, decorated for the interpreter (CPU tensors) or
    compiled (CUDA). The canonical module, which the engine imports, stays untouched."""
    name = "deltaserve.layers.kernels.moe.triton_moe"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        origin = importlib.util.find_spec(name).origin
        spec = importlib.util.spec_from_file_location(name + ("_interpreted" if interpret else "_compiled"), origin)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


tm = kernel_module(interpret=True)
# later test modules and the engine decorate their kernels after this: leave the switch as found
# (the kernel_env fixture turns it on around each CPU test)
if _INTERPRET_BEFORE is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE
compiled_kernels = functools.cache(functools.partial(kernel_module, interpret=False))


def make_inputs(*, tokens, hidden, inter, local, total, top_k, offset, dtype=torch.float32, device="cpu", seed=0):
    """Weights of `local` experts out of `total`; routing over all `total` experts (so some tokens go
    to experts of other ranks), top_k > 1 and, with few experts, repeats across tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(local, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(local, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, total, generator=g)
    weights, ids = naive.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=True)
    to = dict(dtype=dtype, device=device)
    return dict(
        hidden=x.to(**to),
        w13=w13.to(**to),
        w2=w2.to(**to),
        topk_weights=weights.to(**to),
        topk_ids=ids.to(device),
        expert_offset=offset,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # tokens, hidden, inter, local experts, total experts, top_k, offset
    (3, 48, 24, 8, 8, 2, 0),  # no EP; hidden / inter not multiples of the 16-wide tiles' K
    (5, 32, 16, 4, 12, 3, 4),  # EP: experts 4..7 of 12 are local
    (22, 40, 40, 6, 6, 4, 0),  # many repeats per expert: several blocks per expert in the sorted path
    (9, 32, 16, 5, 15, 2, 10),  # EP, the last rank
]


# the pairs path is for a handful of pairs: the interpreter runs one program per pair, so the case
# with 88 pairs runs the sorted path only
PATH_CASES = [(path, *c) for c in CASES for path in ("pairs", "sorted") if path == "sorted" or c[0] * c[5] <= 32]


@pytest.mark.parametrize("path,tokens,hidden,inter,local,total,top_k,offset", PATH_CASES)
def test_fused_moe(path, tokens, hidden, inter, local, total, top_k, offset):
    args = make_inputs(tokens=tokens, hidden=hidden, inter=inter, local=local, total=total, top_k=top_k, offset=offset)
    ref = naive.fused_moe(**args)
    out = tm.fused_moe(**args, path=path)
    assert rel_err(out, ref) < 1e-5


def test_fused_moe_tokens_without_local_experts():
    """Tokens routed only to other ranks' experts get zeros; the default path choice on both sides
    of PAIRS_PATH_MAX."""
    for tokens in (2, tm.PAIRS_PATH_MAX):
        args = make_inputs(tokens=tokens, hidden=32, inter=16, local=4, total=16, top_k=2, offset=8)
        args["topk_ids"][0] = torch.tensor([0, 15])
        args["topk_ids"][1] = torch.tensor([9, 9 + 4])
        ref = naive.fused_moe(**args)
        out = tm.fused_moe(**args)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert rel_err(out, ref) < 1e-5


def test_align_pairs_layout():
    """Every local pair lands once inside its expert's padded block range; padding rows hold the
    sentinel; block_expert matches; non-local pairs appear nowhere."""
    ids = torch.tensor([[3, 1], [3, 5], [0, 3], [1, 2], [6, 3], [3, 4]])
    local, offset, block_m = 4, 1, 2  # local experts are global 1..4
    sorted_ids, block_expert, offsets = tm.align_pairs(
        topk_ids=ids, num_experts=local, expert_offset=offset, block_m=block_m
    )
    flat = ids.flatten() - offset
    counts = torch.bincount(flat[(flat >= 0) & (flat < local)], minlength=local)
    padded = (counts + block_m - 1) // block_m * block_m
    assert offsets.tolist() == [0, *padded.cumsum(0).tolist()]
    total = int(offsets[-1])
    rows = sorted_ids[:total]
    for e in range(local):
        members = rows[offsets[e] : offsets[e + 1]]
        real = members[members < ids.numel()]
        assert sorted(real.tolist()) == torch.nonzero(flat == e).flatten().tolist()
        assert (members[len(real) :] == ids.numel()).all()
        first, last = int(offsets[e]) // block_m, int(offsets[e + 1]) // block_m
        assert (block_expert[first:last] == e).all()
    assert (block_expert[total // block_m :] == -1).all()


def test_fused_moe_strided_hidden():
    args = make_inputs(tokens=6, hidden=32, inter=16, local=4, total=4, top_k=2, offset=0)
    wide = torch.randn(6, 64)
    wide[:, :32] = args["hidden"]
    args["hidden"] = wide[:, :32]
    ref = naive.fused_moe(**args)
    for path in ("pairs", "sorted"):
        assert rel_err(tm.fused_moe(**args, path=path), ref) < 1e-5


# --- GPU, bf16, the real shapes (hidden 2048, 256 experts, top-8, expert width 512) ---------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 256, 2048, 4096, 8192])
def test_gpu_fused_moe_bf16(tokens):
    kernels = compiled_kernels()
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=256,
        total=256,
        top_k=8,
        offset=0,
        dtype=torch.bfloat16,
        device="cuda",
        seed=tokens,
    )
    assert rel_err(kernels.fused_moe(**args), naive.fused_moe(**args)) < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 256])
def test_gpu_fused_moe_expert_parallel_bf16(tokens):
    kernels = compiled_kernels()
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=64,
        total=256,
        top_k=8,
        offset=128,
        dtype=torch.bfloat16,
        device="cuda",
        seed=tokens + 1,
    )
    ref = naive.fused_moe(**args)
    out = kernels.fused_moe(**args)
    if ref.abs().max() == 0:  # no token reached this rank
        assert torch.equal(out, ref)
    else:
        assert rel_err(out, ref) < 2e-2
