"""The decode step's kernel launches, counted on the CPU (bench/launches.py), at the Qwen3.5-35B-A3B
shape: with adapters at batch 1 the MoE layers keep the pairs path's GEMVs (no grouping or grouped
GEMMs), and the adapters add a bounded number of launches a layer; the count leaves no fake tensor
in the kernels' device caches (a later real CPU launch would read it)."""

import torch
from torch._subclasses.fake_tensor import FakeTensor

from deltaserve.bench.launches import decode_launches
from deltaserve.layers.kernels.device import ticket_counters


def test_lora_decode_keeps_the_pairs_path():
    base = decode_launches("qwen3_5_35b_a3b", 1, 0)
    lora = decode_launches("qwen3_5_35b_a3b", 1, 8)
    layers = base["triton._up_gemv_kernel"]
    assert layers == 40 and lora["triton._up_gemv_kernel"] == layers and lora["triton._down_gemv_kernel"] == layers
    assert lora["triton._up_kernel"] == 0 and lora["triton._sum_kernel"] == 0, "no sorted path at decode sizes"
    assert lora["triton._align_kernel"] == 1, "the pass's rows are grouped once, for every projection"
    # per layer: 3 projections' shrink + expand, the shared expert's, router + keys + 2 pair shrinks, the norm
    added = sum(lora.values()) - sum(base.values())
    assert added <= 14 * layers, added
    assert not isinstance(ticket_counters(torch.device("cpu"), 1, "moe_down_norm"), FakeTensor)


def test_speculative_step_launches():
    """One speculative step at the same shape (k = 3, batch 1): every dense projection of the
    4-token verify takes the few-row GEMV (the head's single-token drafts the one-row one),
    write-on-accept is one recurrent and one conv launch for all the GDN layers, and the verify's
    attention applies its gate inside the kernel; the torch glue stays a handful of launches, not a
    few per layer; no fake tensor is left in the process's row-start buffers."""
    from deltaserve.bench.launches import spec_step_launches
    from deltaserve.layers import base

    counts = spec_step_launches("qwen3_5_35b_a3b", 1, 3)
    assert counts["triton._linear_kernel"] == 0 and counts["triton._rows_gemv_kernel"] >= 120
    assert counts["triton._accept_kernel"] == counts["triton._conv_accept_kernel"] == 1  # every layer at once
    assert counts["torch.sigmoid"] == 0 and counts["torch.index_put_"] == 0
    torch_ops = sum(v for k, v in counts.items() if k.startswith("torch."))
    assert torch_ops < 60, {k: v for k, v in counts.items() if k.startswith("torch.")}
    assert not any(isinstance(t, FakeTensor) for bufs in base._ROW_STARTS.values() for t in bufs)
