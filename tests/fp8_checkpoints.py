"""Block-FP8 checkpoints made from the tiny transformers checkpoints, the way Qwen's FP8 releases
are laid out (config.json's quantization_config; each quantized `X.weight` in float8_e4m3fn beside
`X.weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)] float32; the router, the shared-expert
gate, the GDN b / a projections, norms, embeddings and lm_head left as they are; experts one tensor
each), and their dequantized twins (the same values in float32, no quantization_config). The
quantizer here is written apart from deltaserve's, in plain torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB_SIZE

BLOCK = 128
E4M3_MAX = 448.0
# the modules a Qwen FP8 release quantizes, by the last part of their name
QUANTIZED = {
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj", "gate_proj",
    "up_proj", "down_proj",
}  # fmt: skip


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 factors) of w [R, C]: per block s = amax / 448, q = w / s."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale = max(tile.abs().max().item(), 1e-10) / E4M3_MAX
            s[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / s[i, j]).clamp(-448, 448).to(q.dtype)
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    rows, cols = q.shape
    full = s.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return q.float() * full


def _unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) as one
    tensor per expert and projection, the layout of Qwen's FP8 releases."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def make_fp8(src: Path, fp8_dir: Path, twin_dir: Path, ignored: tuple[str, ...] = ()) -> dict:
    """Write the FP8 checkpoint of the tiny checkpoint `src` and its dequantized twin. `ignored`:
    module names (as in modules_to_not_convert) to leave unquantized besides the usual ones.
    Returns the quantization_config written."""
    tensors = {}
    for path in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    tensors = _unfuse_experts(tensors)
    fp8, twin, not_converted = {}, {}, []
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dim() == 2 and module.rpartition(".")[2] in QUANTIZED and module not in ignored:
            q, s = quantize_blocks(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize_blocks(q, s)
        else:
            fp8[name] = twin[name] = t
            if leaf == "weight" and t.dim() == 2:
                not_converted.append(module)
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(not_converted),
    }
    config = json.loads((Path(src) / "config.json").read_text())
    for out_dir, out, cfg in ((fp8_dir, fp8, {**config, "quantization_config": quant}), (twin_dir, twin, config)):
        out_dir.mkdir(parents=True, exist_ok=True)
        for extra in ("generation_config.json", "tokenizer.json"):
            if (Path(src) / extra).is_file():
                shutil.copy(Path(src) / extra, out_dir / extra)
        (out_dir / "config.json").write_text(json.dumps(cfg))
        save_file(out, str(out_dir / "model.safetensors"))
    return quant


# Engine runs with FP8 weights on the Qwen-shaped tiny MoE (test_fp8_model, test_gpu_fp8_engine).
# Prefill passes (> 16 rows) quantize activations, and W8A8 is chaotic in the last float32 bits: an
# activation near a float8 midpoint rounds either way on two correct implementations, which moves its
# token's MoE output by ~1e-2 (a routing choice further on), and every later layer and token. Measured
# on the CPU path with relative noise at every activation quantizer's input, median / max prompt-logprob
# gap: 1e-7 (one ulp): 4e-4 / 4e-2; 1e-6: 4e-3 / 0.13; 1e-5: 1.2e-2 / 0.26; 1e-4: 1.5e-2 / 0.31 (the
# twin, no activation quantization: 1.6e-2 / 0.32). Bugs in the MoE's quantization give medians of
# 3.4e-2 (truncating instead of rounding), 7e-2 (scales one group off), 0.25 (scales off by 2).
PREFILL_MEDIAN_GAP = 2.5e-2


def engine_prompts() -> list[list[int]]:
    """Prompts of 1 to 300 tokens: prefill passes of several sequences and chunks at a 97-token budget."""
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 300, 9)]
