"""align_pairs (the sorted MoE path's grouping of (token, slot) pairs by local expert) against a
plain-torch stable sort by expert: the single-launch kernel exactly (ascending pairs within an
expert), the two-launch path above ALIGN_ONE_LAUNCH_MAX as a grouping (its order within an expert
is free), its counters back at zero after each call. Interpreted on CPU tensors without CUDA,
compiled on the GPU with it."""

import pytest
import torch

from deltaserve.layers.kernels.device import ticket_buffers
from deltaserve.layers.kernels.moe import align as tm

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture; nan_fill: torch.empty hands out
# integers at their largest value, so an output element the kernel never writes fails the checks
pytestmark = pytest.mark.usefixtures("nan_fill")


def reference_align_pairs(
    *, topk_ids: torch.Tensor, num_experts: int, expert_offset: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_pairs in plain torch: a stable sort of the local pairs by expert (ascending pair index
    within an expert), each expert's rows padded to a multiple of block_m with the sentinel
    num_pairs. Same shapes as align_pairs; rows of sorted_ids past offsets[E] hold the sentinel."""
    flat = topk_ids.flatten().long() - expert_offset
    num_pairs = flat.numel()
    local = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[local], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = padded.cumsum(0)
    max_blocks = -(-num_pairs // block_m) + min(num_pairs, num_experts)
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    order = torch.argsort(torch.where(local, flat, num_experts), stable=True)[: int(local.sum())]
    experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # unpadded start of each expert in `order`
    rank = torch.arange(order.numel()) - first_of_expert[experts]
    sorted_ids[offsets[experts] + rank] = order.to(torch.int32)
    for e in range(num_experts):
        block_expert[int(offsets[e]) // block_m : int(offsets[e + 1]) // block_m] = e
    return sorted_ids, block_expert, offsets.to(torch.int32)


def make_ids(num_pairs: int, *, top_k: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    """topk_ids [T, top_k] flattening to exactly num_pairs pairs (top_k = 1 when it does not divide
    num_pairs), global expert ids uniform in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(lo, hi, (num_pairs,), generator=g)
    return ids.view(-1, top_k if num_pairs % top_k == 0 else 1)


def check_exact(ids, num_experts, expert_offset, block_m, out):
    sorted_ids, block_expert, offsets = (t.cpu() for t in out)
    ref_sorted, ref_block_expert, ref_offsets = reference_align_pairs(
        topk_ids=ids.cpu(), num_experts=num_experts, expert_offset=expert_offset, block_m=block_m
    )
    assert sorted_ids.shape == ref_sorted.shape and block_expert.shape == ref_block_expert.shape
    assert torch.equal(offsets, ref_offsets)
    total = int(ref_offsets[-1])
    assert torch.equal(sorted_ids[:total], ref_sorted[:total])
    assert torch.equal(block_expert, ref_block_expert)


# num_pairs, top_k, local experts, expert_offset, routed ids in [lo, hi), block_m
# (the kernel's cost under the interpreter follows the pairs' power of two, BLOCK_P: its sort)
ONE_LAUNCH_CASES = [
    (1, 1, 8, 0, 0, 8, 16),
    (7, 1, 8, 8, 0, 24, 32),  # EP: experts 8..15 of 24 local
    (65, 1, 8, 0, 0, 8, 64),  # several blocks per expert
    (128, 8, 256, 0, 0, 256, 16),  # the decode batch 16 shape
    (128, 8, 256, 256, 0, 512, 16),  # EP: the upper half local
    (333, 1, 256, 0, 0, 256, 32),  # an odd count in a 512-pair sort, one or two pairs per expert
    (200, 1, 8, 16, 12, 26, 16),  # EP, non-local ids on both sides, ~14 pairs per expert
    # the threshold; EP in the middle; 576 blocks: the -1 fill of block_expert in two 512-block chunks
    (1024, 8, 512, 64, 0, 640, 16),
    (256, 8, 8, 0, 0, 8, 16),  # 32 pairs per expert: several blocks each
    (256, 8, 256, 0, 0, 16, 16),  # 16 of 256 experts used
]


@pytest.mark.parametrize("num_pairs,top_k,local,offset,lo,hi,block_m", ONE_LAUNCH_CASES)
def test_align_pairs_one_launch_exact(device, num_pairs, top_k, local, offset, lo, hi, block_m):
    assert num_pairs <= tm.ALIGN_ONE_LAUNCH_MAX
    ids = make_ids(num_pairs, top_k=top_k, lo=lo, hi=hi, seed=num_pairs + block_m).to(device)
    out = tm.align_pairs(topk_ids=ids, num_experts=local, expert_offset=offset, block_m=block_m)
    check_exact(ids, local, offset, block_m, out)


def test_align_pairs_one_launch_edges(device):
    """No local pair at all (offsets all 0, block_expert all -1); then the two boundary experts."""
    ids = torch.tensor([[0, 1], [2, 3], [12, 13]], device=device)
    out = tm.align_pairs(topk_ids=ids, num_experts=8, expert_offset=4, block_m=16)
    check_exact(ids, 8, 4, 16, out)
    assert (out[1].cpu() == -1).all()
    ids[2] = torch.tensor([4, 11], device=device)
    check_exact(ids, 8, 4, 16, tm.align_pairs(topk_ids=ids, num_experts=8, expert_offset=4, block_m=16))


def check_grouping(ids, num_experts, expert_offset, block_m, out):
    """The two-launch path: the same offsets, block_expert and padding as the reference, the same set
    of pairs per expert (their order within an expert is free), and its counters (experts' and the
    ticket) left at zero for the next call."""
    sorted_ids, block_expert, offsets = (t.cpu() for t in out)
    ref_sorted, ref_block_expert, ref_offsets = reference_align_pairs(
        topk_ids=ids.cpu(), num_experts=num_experts, expert_offset=expert_offset, block_m=block_m
    )
    assert torch.equal(offsets, ref_offsets)
    assert torch.equal(block_expert, ref_block_expert)
    for e in range(num_experts):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        assert torch.equal(sorted_ids[lo:hi].sort().values, ref_sorted[lo:hi].sort().values)
    for buf in ticket_buffers("moe_align", ids.device):
        assert not buf.any()


@pytest.mark.parametrize("num_experts,total,offset,block_m", [(256, 256, 0, 16), (8, 16, 8, 32)])
def test_align_pairs_two_launch_path_above_threshold(device, num_experts, total, offset, block_m):
    ids = make_ids(tm.ALIGN_ONE_LAUNCH_MAX + 1, top_k=1, lo=0, hi=total, seed=5).to(device)
    out = tm.align_pairs(topk_ids=ids, num_experts=num_experts, expert_offset=offset, block_m=block_m)
    check_grouping(ids, num_experts, offset, block_m, out)


def test_align_pairs_two_launch_path_forced(device):
    """The two-launch path where the single launch would run (one_launch=False): the same grouping,
    twice in a row on the same counters (the second call starts from the zeros the first left)."""
    ids = make_ids(128, top_k=8, lo=0, hi=48, seed=9).to(device)
    for _ in range(2):
        out = tm.align_pairs(topk_ids=ids, num_experts=16, expert_offset=16, block_m=16, one_launch=False)
        check_grouping(ids, 16, 16, 16, out)


def test_align_pairs_two_launch_spaced_counters(device):
    """The experts' counters spaced apart (count_stride), with other launch shapes: the same grouping,
    twice in a row, every counter back at zero after each call."""
    from deltaserve.layers.kernels.moe import align

    ids = make_ids(600, top_k=4, lo=0, hi=40, seed=11).to(device)
    cfg = dict(block_p=128, count_warps=1, place_warps=8, count_stride=32)
    for _ in range(2):
        out = align.align_pairs(topk_ids=ids, num_experts=32, expert_offset=4, block_m=16, one_launch=False, config=cfg)
        check_grouping(ids, 32, 4, 16, out)
