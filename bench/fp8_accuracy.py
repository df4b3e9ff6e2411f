"""FP8 against bf16 on the same random model: the next-token distribution at every position of one
random prompt, from the bf16 weights, from the same weights quantized to block FP8 at load, and
from the dequantized twin (the FP8 weights dequantized back into bf16 parameters: the plain bf16
kernels on the FP8 model's weights).

    python -m deltaserve.bench.fp8_accuracy --preset qwen3_5_35b_a3b --tokens 1000 --decode 64 --json out.json

Positions 0 .. tokens - decode - 1 come from one prefill pass (FP8: activations quantized per
1 x 128 group, the tensor-core path); the last `decode` positions one token a pass (FP8: the decode
GEMVs, activations as they are). Per part and pair of models: top-1 agreement of the next token, the
mean KL divergence KL(a || b) of the next-token distributions (float32 softmax of each model's
logits) and the mean Pearson correlation of the logit rows. The pairs split the FP8 error in two:
twin against bf16 is the weights' e4m3 rounding alone, FP8 against twin the FP8 kernels and the
activation quantization alone. `unrelated` compares bf16 with itself one position later (another
token's distribution): the level of two unrelated outputs of this model.

Per layer (the residual stream after each decoder layer, hooks on the layers; each figure the median
over tokens, which a few tokens whose MoE routing flipped do not move):
- free: the relative error ||a - b|| / ||b|| of the stream, the models running on their own (the
  error carried from every earlier layer and position: where divergence starts and how it grows);
- local: each layer of the FP8 model and of the twin fed the bf16 model's stream at its input (its
  GDN / KV state from its own earlier passes fed alike): ||out_a - out_b|| / ||out_b - in||, the
  error one layer adds, against what that layer adds. Twin vs bf16: the weight rounding's; FP8 vs
  twin: the kernels' and activation quantization's (a kernel bug reads as tens of percent). With
  `--prefill-chunk 8` no pass quantizes an activation: FP8 against twin is then the GEMVs (weights
  dequantized in registers, float32 accumulation) against the bf16 kernels alone, a few bf16 roundings.

A random model compounds these errors: each layer's local error is a few percent (e4m3 keeps 3
mantissa bits), but the free error grows layer after layer (routing near-ties flip, GDN state carries
it to later positions). On the CPU path (plain torch, float32, no GPU kernel), a 40-layer random model
of this family at hidden 1024 (the command below) ends with FP8 against full precision at top-1 41%,
mean KL 0.054 (two unrelated positions of the bf16 model: 0.074), logit correlation 0.87 (unrelated:
0.82), free error 0.51 after the last layer, while every layer's local error stays at 3-7%; another
seed gave top-1 0%, KL 0.15, correlation 0.63. On random weights the logits' agreement says little
about the kernels; the local errors do (`--layers` shortens the model to see the error before it
compounds). That CPU run (about 2 minutes, 4 GB):

    python -m deltaserve.bench.fp8_accuracy --device cpu --tokens 72 --decode 8 --set hidden_size=1024 \
        --set num_attention_heads=8 --set linear_num_key_heads=8 --set linear_num_value_heads=16 \
        --set num_experts=16 --set num_experts_per_tok=4 --set moe_intermediate_size=256 \
        --set shared_expert_intermediate_size=256 --set vocab_size=32768

The models load one after the other: bf16, then FP8, which becomes the twin in place (one GPU holds
either); only logits and layer outputs (bf16) go to the host.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels import fp8 as fp8_kernels
from deltaserve.layers.loader import load_model
from deltaserve.layers.quant import layout
from deltaserve.workers.context import build_forward_context, logits_rows
from deltaserve.workers.plan import PassPlan, PoolSizes
from deltaserve.workers.state_pool import StatePool

from .presets import PRESETS, preset_config, preset_hf_config

BLOCK_SIZE = 16
PAIRS = (("bf16", "fp8"), ("bf16", "twin"), ("twin", "fp8"))  # (reference, ours)
SHOWN_LAYERS = 6  # the first layers printed one by one (then every STEP-th, and the last)
STEP = 5


@dataclass
class LayerTap:
    """Hooks on a model's decoder layers: each call's output (hidden, residual, normed) recorded on
    the host, per pass; with `force`, each layer's input replaced by the recorded output of the
    layer before it in another model (the same pass), so that every layer sees that model's stream."""

    force: list[list[tuple]] | None = None  # [pass][layer] -> (hidden, residual, normed) of a run
    passes: list[list[tuple]] = field(default_factory=list)
    handles: list = field(default_factory=list)

    def attach(self, model: nn.Module) -> LayerTap:
        for i, layer in enumerate(model.layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post(i), with_kwargs=True))
        return self

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, i: int):
        def hook(module, args, kwargs):
            if i == 0:
                self.passes.append([])
            if self.force is None or i == 0:  # layer 0's input is the embedding, the same everywhere
                return None
            hidden, residual, normed = self.force[len(self.passes) - 1][i - 1]
            device = args[0].device
            residual = None if residual is None else residual.to(device)
            return (hidden.to(device), residual, *args[2:]), {**kwargs, "input_normed": normed}

        return hook

    def _post(self, i: int):
        def hook(module, args, kwargs, out):
            hidden, residual, normed = out
            # a copy even on the CPU, where later in-place kernels could otherwise reach the record
            host = (None if t is None else t.to("cpu", copy=True) for t in (hidden, residual))
            self.passes[-1].append((*host, bool(normed)))

        return hook


def stream(hidden: torch.Tensor, residual: torch.Tensor | None, normed: bool) -> torch.Tensor:
    """The residual stream after a layer, float32: its residual when the next norm was applied
    (hidden is then that norm's output), else hidden + residual."""
    if normed:
        return residual.float()
    return hidden.float() if residual is None else hidden.float() + residual.float()


def _pass(model, pool, ids: list[int], start: int, block_size: int, pass_id: int, device: str) -> torch.Tensor:
    """One pass of tokens ids (positions start ..) of the one sequence (pages 1.., slot 0): the
    logits of every token, float32 [len(ids), V]."""
    end = start + len(ids)
    pages = list(range(1, -(-end // block_size) + 1))
    plan = PassPlan(
        pass_id=pass_id,
        req_ids=["a"],
        num_decode_rows=1 if (len(ids) == 1 and start > 0) else 0,
        input_ids=np.array(ids, np.int32),
        positions=np.arange(start, end, dtype=np.int32),
        slot_mapping=np.array([pages[p // block_size] * block_size + p % block_size for p in range(start, end)]),
        query_start_loc=np.array([0, len(ids)], np.int32),
        seq_lens=np.array([end], np.int32),
        block_tables=np.array([pages], np.int32),
        state_slots=np.array([0], np.int32),
        has_initial_state=np.array([start > 0], bool),
        sample_rows=np.ones(1, bool),
        prompt_logprob_rows=np.ones(1, bool),
    )
    indices, _ = logits_rows(plan)
    ctx = build_forward_context(plan, model.config, model.layout, device, indices)
    with torch.inference_mode():
        hidden = model(ctx, pool.layer_states)
        return model.compute_logits(hidden[ctx.logits_indices]).float()


def prefill_spans(head: int, chunk: int) -> list[tuple[int, int]]:
    """The prefill part's passes: [start, end) of each (one pass when chunk is 0)."""
    step = chunk or max(head, 1)
    return [(s, min(s + step, head)) for s in range(0, head, step)]


def run_passes(
    model, ids: list[int], decode: int, device: str, dtype: torch.dtype, tap: LayerTap | None = None,
    chunk: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Logits of the prompt's positions (the prefill part in one pass, or in passes of `chunk`
    tokens; then one token a pass) on the host, from a fresh state pool; `tap`: hooked on the
    layers meanwhile."""
    sizes = PoolSizes(num_blocks=-(-len(ids) // BLOCK_SIZE) + 2, block_size=BLOCK_SIZE, num_slots=2)
    pool = StatePool(model, sizes, dtype=dtype, device=device)
    if tap is not None:
        tap.attach(model)
    try:
        spans = prefill_spans(len(ids) - decode, chunk) + [(i, i + 1) for i in range(len(ids) - decode, len(ids))]
        parts = [_pass(model, pool, ids[s:e], s, BLOCK_SIZE, n, device).cpu() for n, (s, e) in enumerate(spans)]
    finally:
        if tap is not None:
            tap.detach()
    del pool
    return torch.cat(parts)


def _load(config: ModelConfig, quantization: str | None, seed: int, device: str, dtype: torch.dtype) -> nn.Module:
    return load_model(None, config=config, dtype=dtype, device=device, load_format="random", seed=seed,
                      quantization=quantization)  # fmt: skip


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _free(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def dequantize_in_place(model: nn.Module, dtype: torch.dtype) -> int:
    """The model's dequantized twin, in place: every FP8 weight (float8 rows, block scales, tail)
    becomes one plain parameter in `dtype` holding its values times its scales (computed in float32,
    then rounded to `dtype`) followed by its tail rows; the kernels then take their plain paths.
    One weight (one leading index of an expert tensor) at a time, so that the peak is the twin's size.
    Returns the number of weights converted."""
    converted = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            lay = None if param is None else layout(param)
            if lay is None:
                continue
            *lead, rows, cols = param.shape
            full = rows + (0 if lay.tail is None else lay.tail.shape[-2])
            out = torch.empty(*lead, full, cols, dtype=dtype, device=param.device)
            flat_q, flat_s, flat_out = param.reshape(-1, rows, cols), lay.scale, out.view(-1, full, cols)
            flat_s = flat_s.reshape(-1, *flat_s.shape[-2:])
            for i in range(flat_q.shape[0]):
                flat_out[i, :rows] = fp8_kernels.dequantize_weight(flat_q[i], flat_s[i], dtype)
            if lay.tail is not None:
                out[..., rows:, :] = lay.tail
                del module._parameters[name + "_tail"]
            del module._parameters[name + "_scale"]
            module._parameters[name] = nn.Parameter(out, requires_grad=False)
            converted += 1
    return converted


def compare(ref: torch.Tensor, ours: torch.Tensor) -> dict:
    """Top-1 agreement, mean KL(ref || ours) and the mean correlation of the logit rows."""
    logp_ref, logp = ref.log_softmax(-1), ours.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    a, b = ref - ref.mean(-1, keepdim=True), ours - ours.mean(-1, keepdim=True)
    corr = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-30)
    return {
        "positions": int(ref.shape[0]),
        "top1_agreement": (ref.argmax(-1) == ours.argmax(-1)).float().mean().item(),
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
        "logit_corr": corr.mean().item(),
    }


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """The median over tokens of ||a - b|| / ||scale|| per token row: robust to the few tokens whose
    MoE routing flipped (a near-tie among the router's top-k moves a token's output by a whole
    expert's share), while an error in a kernel moves every token."""
    per_token = (a - b).norm(dim=-1) / scale.norm(dim=-1).clamp_min(1e-30)
    return per_token.median().item()


def _streams(passes: list[list[tuple]], first: int, last: int) -> list[torch.Tensor]:
    """Per layer, the stream after it over passes [first, last), rows concatenated."""
    layers = len(passes[0])
    return [torch.cat([stream(*passes[p][i]) for p in range(first, last)]) for i in range(layers)]


def layer_errors(
    runs: dict[str, list], forced: dict[str, list], embed_stream: list[torch.Tensor], prefill_passes: int
) -> dict:
    """Per part (the prefill passes / the decode passes) and layer: the free-running streams'
    relative errors per pair, and the local errors of the forced runs (see the module docstring)."""
    out = {}
    num_passes = len(runs["bf16"])
    for part, (p0, p1) in (("prefill", (0, prefill_passes)), ("decode", (prefill_passes, num_passes))):
        if p1 <= p0:
            continue
        free = {name: _streams(r, p0, p1) for name, r in runs.items()}
        ins = [torch.cat(embed_stream[p0:p1])] + free["bf16"][:-1]  # the bf16 stream into each layer
        forced_s = {name: _streams(r, p0, p1) for name, r in forced.items()}
        n = range(len(free["bf16"]))
        twin, fp8 = forced_s["twin"], forced_s["fp8"]
        out[part] = {
            "free": {f"{a}~{b}": [_rel(free[b][i], free[a][i], free[a][i]) for i in n] for a, b in PAIRS},
            "local": {
                "bf16~twin": [_rel(twin[i], free["bf16"][i], free["bf16"][i] - ins[i]) for i in n],
                "twin~fp8": [_rel(fp8[i], twin[i], twin[i] - ins[i]) for i in n],
            },
        }
    return out


class EmbedTap:
    """The stream into layer 0 per pass (its residual: the embedding), recorded on the host."""

    def __init__(self) -> None:
        self.streams: list[torch.Tensor] = []

    def attach(self, model: nn.Module):
        def hook(module, args, kwargs):
            hidden, residual = args[0], args[1]
            self.streams.append((hidden if residual is None else residual).to("cpu", torch.float32, copy=True))

        return model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)


def measure(
    config: ModelConfig, ids: list[int], decode: int, seed: int, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16, chunk: int = 0, log=print,
) -> dict:  # fmt: skip
    """The three models' logits and layer errors (module docstring) as a report dict; chunk: the
    prefill part in passes of this many tokens (0: one pass). Layer errors need the decoder layers'
    LayerOut (not Qwen4-Exp's stream mixers: logits only there)."""
    head = len(ids) - decode
    layered = config.family != "qwen4_exp"
    logits, runs, forced, info = {}, {}, {}, {}
    t0 = time.perf_counter()
    model = _load(config, None, seed, device, dtype)
    info["bf16"] = {"load_s": time.perf_counter() - t0, "weight_bytes": _weight_bytes(model)}
    log(f"bf16: loaded in {info['bf16']['load_s']:.0f} s, {info['bf16']['weight_bytes'] / 1e9:.1f} GB")
    tap, embed = LayerTap(), EmbedTap()
    handle = embed.attach(model) if layered else None
    logits["bf16"] = run_passes(model, ids, decode, device, dtype, tap if layered else None, chunk)
    if handle is not None:
        handle.remove()
    runs["bf16"] = tap.passes
    del model
    _free(device)
    t0 = time.perf_counter()
    model = _load(config, "fp8", seed, device, dtype)
    info["fp8"] = {"load_s": time.perf_counter() - t0, "weight_bytes": _weight_bytes(model)}
    log(f"fp8: loaded in {info['fp8']['load_s']:.0f} s, {info['fp8']['weight_bytes'] / 1e9:.1f} GB")
    for name in ("fp8", "twin"):
        if name == "twin":
            converted = dequantize_in_place(model, dtype)
            _free(device)
            info["twin"] = {"weight_bytes": _weight_bytes(model), "converted": converted}
            log(f"twin: {converted} FP8 weights dequantized to {dtype}, {info['twin']['weight_bytes'] / 1e9:.1f} GB")
        tap = LayerTap()
        logits[name] = run_passes(model, ids, decode, device, dtype, tap if layered else None, chunk)
        runs[name] = tap.passes
        if layered:
            tap = LayerTap(force=runs["bf16"])
            run_passes(model, ids, decode, device, dtype, tap, chunk)
            forced[name] = tap.passes
    del model
    _free(device)
    report: dict = {"models": info}
    logits = {name: t.to(device) for name, t in logits.items()}  # the models are gone: the GPU compares faster
    for part, rows in (("prefill", slice(0, head)), ("decode", slice(head, None)), ("all", slice(None))):
        report[part] = {f"{a}~{b}": compare(logits[a][rows], logits[b][rows]) for a, b in PAIRS}
        ref = logits["bf16"][rows]
        if ref.shape[0] > 1:
            report[part]["unrelated"] = compare(ref[:-1], ref[1:])
    report["layers"] = layer_errors(runs, forced, embed.streams, len(prefill_spans(head, chunk))) if layered else {}
    return report


def format_report(report: dict) -> list[str]:
    lines = []
    for part in ("prefill", "decode", "all"):
        for pair, r in report[part].items():
            lines.append(
                f"{part:>7} {pair:>10}: {r['positions']} positions, top-1 agreement {100 * r['top1_agreement']:5.1f}%, "
                f"mean KL {r['mean_kl']:.3e} (max {r['max_kl']:.3e}), logit corr {r['logit_corr']:.4f}"
            )
    for part, errs in report["layers"].items():
        lines.append(f"per-layer relative error of the residual stream, {part}:")
        cols = [("free", p) for p in errs["free"]] + [("local", p) for p in errs["local"]]
        lines.append("  layer " + "".join(f"{kind + ' ' + pair:>17}" for kind, pair in cols))
        layers = len(errs["free"]["bf16~fp8"])
        shown = sorted({*range(min(SHOWN_LAYERS, layers)), *range(0, layers, STEP), layers - 1})
        for i in shown:
            lines.append(f"  {i:5d} " + "".join(f"{errs[kind][pair][i]:17.3e}" for kind, pair in cols))
    if report["layers"]:
        parts = list(report["layers"])
        local = [
            f"{pair} " + " / ".join(f"{100 * max(report['layers'][p]['local'][pair]):.2f}%" for p in parts)
            for pair in ("twin~fp8", "bf16~twin")
        ]  # fmt: skip
        last = " / ".join(f"{100 * report['layers'][p]['free']['bf16~fp8'][-1]:.1f}%" for p in parts)
        lines.append(
            f"summary ({' / '.join(parts)}): largest local error of a layer {', '.join(local)}; "
            f"free error after the last layer bf16~fp8 {last}"
        )
    return lines


def truncated(preset: str, layers: int | None = None, overrides: dict | None = None) -> ModelConfig:
    """A preset's config with only its first `layers` decoder layers (their types kept), and
    `overrides` of its transformers config fields (a narrower model of the same family)."""
    hf = {**preset_hf_config(preset), **(overrides or {})}
    if layers is not None:
        hf["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_only_layers"):
            if isinstance(hf.get(key), list):
                hf[key] = [v for i, v in enumerate(hf[key]) if (i < layers if key == "layer_types" else v < layers)]
    return ModelConfig.from_hf(hf)


def _field(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set takes FIELD=VALUE, got {text[:40]!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--set {name}: the value must be JSON ({e.msg})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_35b_a3b", choices=PRESETS)
    p.add_argument("--tokens", type=int, default=1000, help="prompt positions compared")
    p.add_argument("--decode", type=int, default=64, help="of them, the last ones run one token a pass")
    p.add_argument("--seed", type=int, default=0, help="of the random weights and the prompt")
    p.add_argument(
        "--prefill-chunk", type=int, default=0,
        help="the prefill part in passes of this many tokens (8 or fewer at top-8 routing: at most 16 rows and 64 "
        "routed pairs a pass, so every FP8 pass takes the GEMVs and no activation is quantized); 0: one pass",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="only the first N decoder layers (a shorter model)")
    p.add_argument(
        "--set", type=_field, action="append", default=[], metavar="FIELD=VALUE",
        help="a transformers config field of the preset (JSON value; repeatable): a narrower model of the family",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: the plain-torch reference path in float32 (no Triton kernel; small models only)",
    )  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fp8_accuracy needs a CUDA device (or --device cpu)")
        return 2
    overrides = dict(args.set)
    config = preset_config(args.preset) if args.layers is None and not overrides else truncated(
        args.preset, args.layers, overrides
    )  # fmt: skip
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(10, config.vocab_size - 10, args.tokens).tolist()
    device, dtype = (args.device, torch.bfloat16) if args.device == "cuda" else ("cpu", torch.float32)
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (float32, plain torch)",
        "preset": args.preset, "overrides": overrides, "num_layers": config.num_layers,
        "prefill_chunk": args.prefill_chunk,
    }  # fmt: skip
    report.update(
        measure(
            config, ids, args.decode, args.seed, device, dtype, chunk=args.prefill_chunk,
            log=lambda s: print(s, flush=True),
        )
    )  # fmt: skip
    for line in format_report(report):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
