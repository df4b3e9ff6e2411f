"""bench.kernels_stream's harness reads the weights a sorted GEMM program reads: in each layout
(the checkpoint's rows, contiguous boxes) and by each load (TMA descriptor, pointers), its sums and
its dots over the gathered rows and the rows it stores equal torch's over the same expert slices, so
its timings are of the GEMMs' own bytes (interpreted on the CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltaserve.bench import kernels_stream as ks

E, K, ROWS, HALVES, BN, BK = 2, 128, 64, 2, 16, 32


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("layout,load", list(itertools.product(("rows", "tiles"), ("tma", "ptr"))))
def test_stream_harness_reads_the_gemm_slices(device, layout, load, blocks):
    from triton.tools.tensor_descriptor import TensorDescriptor

    g = torch.Generator().manual_seed(0)
    w = torch.randn(E, ROWS, K, generator=g).to(device)
    x = torch.randn(300, K, generator=g).to(device)
    ids = torch.full((E * blocks, 128), -1, dtype=torch.int32)  # row block b holds expert b // blocks's rows
    ids[:, :50] = torch.randperm(300, generator=g)[: 50 * E * blocks].view(E * blocks, 50).int()
    ids = ids.to(device)
    n_blocks = ROWS // HALVES // BN
    flat = w.view(-1, K) if layout == "rows" else ks._tiled(w, HALVES, BN, BK)
    desc = TensorDescriptor.from_tensor(flat, [BN, BK]) if load == "tma" else flat
    rid = ids.long()
    ok = rid >= 0
    tol = 1e-4 if device.type == "cpu" else 1e-2  # float32 dots run in tf32 on the GPU
    forms = [(False, False, 0), (True, False, 0), (True, True, 0), (True, True, 1), (True, True, 2), (True, True, 3)]
    for dot, gather, store in forms:
        out = torch.full((E * blocks * n_blocks,), float("nan"), device=device)
        y = torch.zeros(max(300, ids.numel()), n_blocks * BN, dtype=torch.bfloat16, device=device)
        y_desc = TensorDescriptor.from_tensor(y, [128, BN])
        ks._stream_kernel[(E * blocks * n_blocks,)](
            desc, flat, out, x, ids, y, y_desc, x.stride(0), y.stride(0), n_blocks, blocks, ROWS, K, HALVES, BN, BK,
            layout == "tiles", load == "tma", dot, gather, store, 2, num_warps=4,
        )  # fmt: skip
        for b, n in itertools.product(range(E * blocks), range(n_blocks)):
            e, half_rows = b // blocks, ROWS // HALVES
            boxes = [w[e, h * half_rows + n * BN : h * half_rows + (n + 1) * BN] for h in range(HALVES)]
            if not dot:
                torch.testing.assert_close(out[b * n_blocks + n], sum(b.sum() for b in boxes), rtol=1e-5, atol=1e-3)
                continue
            if gather:
                a = torch.where(ok[b][:, None], x[rid[b].clamp(min=0)], 0.0)
                acc = sum(a @ b.T for b in boxes)
            else:  # one register tile: the first BK columns of the rows, against every K step
                a = x[rid[b].clamp(min=0), :BK]
                acc = sum(a @ b[:, kb * BK : (kb + 1) * BK].T for b in boxes for kb in range(K // BK))
            if store >= 2:  # the block's own rows, padding rows included
                got = y[b * 128 : (b + 1) * 128, n * BN : (n + 1) * BN].float()
                torch.testing.assert_close(got, acc.bfloat16().float(), rtol=1e-2, atol=1e-2)
            elif store:
                got = y[rid[b][ok[b]], n * BN : (n + 1) * BN].float()
                torch.testing.assert_close(got, acc[ok[b]].bfloat16().float(), rtol=1e-2, atol=1e-2)
            else:
                torch.testing.assert_close(out[b * n_blocks + n], acc.sum(), rtol=tol, atol=tol * 100)
