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
    # per layer: the input projections' shrink + expand (mixer, MoE block), the output projection's
    # shrink (its expand in the norm after it, which leaves the one-row GEMV), the router (not in the
    # up GEMV with expert adapters), the experts' two pair shrinks (the shared expert's in the second)
    added = sum(lora.values()) - sum(base.values())
    assert lora["triton._expand_kernel"] == 2 * layers
    assert added <= 9 * layers + 1, added
    assert not isinstance(ticket_counters(torch.device("cpu"), 1, "moe_down_norm"), FakeTensor)


def test_lora_batch_64_expands_inside_the_experts():
    """The sorted path with adapters: the experts' deltas expand inside the grouped GEMMs (no (slot,
    expert) grouping, expand or zero fill), the shared expert's in the sum kernel with the next norm
    still fused, the output projection's in the norm: 7 launches a layer over the base."""
    base = decode_launches("qwen3_5_35b_a3b", 64, 0)
    lora = decode_launches("qwen3_5_35b_a3b", 64, 8)
    layers = base["triton._up_kernel"]
    assert layers == 40 and lora["triton._up_kernel"] == layers and lora["triton._sum_kernel"] == layers
    assert lora["triton._align_kernel"] == base["triton._align_kernel"] + 1, "the tokens grouped once a pass"
    assert lora["torch.zeros"] == 0 and lora["triton._rms_norm_kernel"] == base["triton._rms_norm_kernel"]
    assert lora["triton._expand_kernel"] == 2 * layers, "only the mixer's and the MoE block's input projections"
    assert sum(lora.values()) - sum(base.values()) == 7 * layers + 1


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


def test_fresh_prompt_captures_cost_two_launches_a_gdn_layer():
    """A fresh 2k prompt's eager pass with its usual prefix-cache captures (every 1,024 tokens, its
    last block boundary, inside the last chunk, and its end): each GDN layer adds one replay launch
    (on the chunked op's own WY rows) and one conv-window launch for all of them, and no torch glue
    (no copies, gathers or index ops per capture)."""
    from deltaserve.bench.launches import prefill_launches

    with_caps = prefill_launches("qwen3_5_35b_a3b", 2048, (1024, 2032, 2048))
    plain = prefill_launches("qwen3_5_35b_a3b", 2048)
    gdn_layers = plain["triton._conv_varlen_kernel"]
    assert gdn_layers == 30
    assert with_caps["triton._advance_kernel"] == with_caps["triton._capture_windows_kernel"] == gdn_layers
    added = {k: with_caps[k] - plain.get(k, 0) for k in with_caps if with_caps[k] != plain.get(k, 0)}
    assert added == {"triton._advance_kernel": gdn_layers, "triton._capture_windows_kernel": gdn_layers}, added
    assert_no_fake_tensor_left()


def assert_no_fake_tensor_left() -> None:
    """The kernels' per-device buffers hold no fake tensor after a counted pass: a later real call on
    the same device would get it (attention's placeholder partials once did: "Cannot copy out of meta
    tensor" in the next real paged attention)."""
    from deltaserve.bench.launches import _DEVICE_CACHES
    from deltaserve.layers.kernels.attention import triton_attention

    for cache in (*_DEVICE_CACHES, triton_attention._NO_PARTIALS):
        for value in cache.values():
            tensors = value if isinstance(value, list) else [value]
            assert not any(isinstance(t, FakeTensor) for t in tensors), cache


def test_fp8_decode_at_batch_1_launches_what_bf16_does():
    """Block-FP8 projections and experts at batch 1: the GEMVs widen the weights in registers, so the
    step launches the same kernels as bf16 (no activation quantization, no dequantized copy); at 16 rows
    the sorted path's W8A8 GEMMs add two quantize launches a layer."""
    bf16, fp8 = decode_launches("qwen3_5_35b_a3b", 1, 0), decode_launches("qwen3_5_35b_a3b", 1, 0, fp8=True)
    assert fp8 == bf16
    at16 = decode_launches("qwen3_5_35b_a3b", 16, 0, fp8=True)
    assert at16["triton._quant_kernel"] == 2 * 40
    assert sum(at16.values()) - sum(decode_launches("qwen3_5_35b_a3b", 16, 0).values()) == 2 * 40
