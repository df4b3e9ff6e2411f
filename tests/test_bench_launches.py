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
