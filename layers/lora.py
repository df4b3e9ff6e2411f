"""LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors) on the served model.

Every projection an adapter may target keeps `max_loras` adapter slots on the device (enable_lora):
a fused projection (attention's q | k | v, GDN's input projections, the MoE block's router | shared
gate / up | shared gate) has one A per checkpoint module (a slice) and one B over its rows; the routed
experts keep ExpertLoraWeights. A pass names each token's slot (ForwardContext.lora) and the layers
add the adapters' deltas right after each projection (`add_lora`), several adapters in one batch.

Parallelism shards the adapters as it shards the weights: a column-parallel projection keeps all of
A and this rank's rows of B; a row-parallel one this rank's columns of A and all of B, its partial
delta summed by the all-reduce that sums the partial outputs (B (sum_r A_r x_r) = sum_r B A_r x_r).

Checkpoint names: transformers' modules (`model.layers.N.self_attn.q_proj`, ...); the routed experts
come per expert (`mlp.experts.N.{gate,up,down}_proj`, what trainers on per-expert modules write) or
fused 3-D (`mlp.experts` targeted through PEFT's target_parameters: A [r * E, in], B [out, r * E],
expert e's A the rows e * r .., its B the columns e, e + E, ..; PEFT nests two targeted parameters
of one module as `experts.base_layer.lora_A` and `experts.lora_A`, told apart here by their shapes).
"""

from __future__ import annotations

import json
import logging
import math
import re
import types
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from .base import ForwardContext, MoeLoraRoute
from .kernels import lora as lora_kernels
from .kernels.lora import ExpertLoraWeights
from .parallel import ParallelLayout, all_reduce

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# config fields naming LoRA variants whose forward is not x -> B A x (their presence refuses the adapter)
_VARIANTS = (
    "use_dora", "use_qalora", "use_bdlora", "arrow_config", "velora_config", "kasa_config", "monteclora_config",
    "alora_invocation_tokens", "trainable_token_indices", "layer_replication", "modules_to_save",
)  # fmt: skip
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.vision_tower.", "model.merger.")
NO_SLOTS = types.MappingProxyType({})  # a layer's adapter slots before enable_lora


class LoraError(ValueError):
    """An adapter deltaserve cannot serve: the message names the adapter file and the field or tensor."""


# ---------------------------------------------------------------------------------------------
# What a layer exposes to adapters
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraTarget:
    """One checkpoint module an adapter may target, and where its delta goes on this rank.

    name: the module's checkpoint name ("model.layers.3.self_attn.q_proj"); owner.lora_slots[key]:
    the projection's slots; shape: the module weight's [out, in]; local_in: the projection's input
    width on this rank. Column-parallel: `rows` (checkpoint row, projection row, count) of B, and
    the slice's place among the projection's slices follows from them. Row-parallel: `cols`
    (first column, count) of A. `expert`: "gate" / "up" / "down" of expert `expert_index` (None: the
    fused 3-D gate_up / down of every expert)."""

    name: str
    owner: torch.nn.Module
    key: str
    shape: tuple[int, int]
    local_in: int
    rows: tuple[tuple[int, int, int], ...] = ()
    cols: tuple[int, int] | None = None
    expert: str = ""
    expert_index: int | None = None

    @property
    def row_range(self) -> tuple[int, int]:
        return min(d for _, d, _ in self.rows), max(d + n for _, d, n in self.rows)


def column_target(name, owner, key, shape, pieces) -> LoraTarget:
    """A column-parallel module (input replicated): B's rows go where the weight's rows go."""
    return LoraTarget(name, owner, key, tuple(shape), shape[1], rows=tuple(pieces))


def row_target(name, owner, key, shape, first_col, cols) -> LoraTarget:
    """A row-parallel module: A's columns [first_col, first_col + cols); all of B."""
    return LoraTarget(name, owner, key, tuple(shape), cols, rows=((0, 0, shape[0]),), cols=(first_col, cols))


@dataclass
class LoraProjection:
    """A projection's adapter slots: a [S, J * R, K], b [S, N, R] (scaling folded in), output rows
    [bounds[j], bounds[j + 1]) read slice j; `present[s]`: slot s holds an adapter on it."""

    a: torch.Tensor
    b: torch.Tensor
    bounds: tuple[int, ...]
    slices: tuple[str, ...]  # a checkpoint module name per slice (errors, tests)
    present: list[bool]


@dataclass
class ExpertLoraSlots:
    """An MoE layer's routed-expert adapter slots."""

    weights: ExpertLoraWeights
    present: list[bool]


# ---------------------------------------------------------------------------------------------
# The hooks the layers call
# ---------------------------------------------------------------------------------------------
def lora_wanted(ctx: ForwardContext | None, slots: LoraProjection | ExpertLoraSlots | None) -> bool:
    """Whether a projection runs its adapters in this pass: a slot of the pass holds one there (a
    CUDA-graph capture runs every projection's, for whatever slots its replays name)."""
    lora = None if ctx is None else ctx.lora
    if lora is None or slots is None:
        return False
    return lora.capture or any(slots.present[s] for s in lora.active)


def add_lora(
    ctx: ForwardContext | None,
    slots: LoraProjection | None,
    y: torch.Tensor,
    x: torch.Tensor,
    *,
    glu: bool = False,
    row_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (the projection of x) plus each token's adapter delta, in place; y itself when none applies.
    glu / row_gate: as lora_kernels.add_lora (x = [gate | up], the delta under sigmoid(row_gate))."""
    if not lora_wanted(ctx, slots):
        return y
    return lora_kernels.add_lora(
        y=y, x=x, a=slots.a, b=slots.b, bounds=slots.bounds, rows=ctx.lora.rows, pdl=ctx.kernels.pdl, glu=glu,
        row_gate=row_gate,
    )  # fmt: skip


def low_rank_lora(
    ctx: ForwardContext | None,
    slots: LoraProjection | None,
    x: torch.Tensor,
    *,
    glu: bool = False,
    fold_into: lora_kernels.ExpertDeltas | None = None,
) -> lora_kernels.PairLowRank | None:
    """A one-slice projection's adapters in low-rank form, for a kernel that adds them to its output
    itself (the MoE's last kernel: the shared expert's down adapter, the next norm kept fused): each
    token's slot, x's shrink [T, R] float32 (glu: as add_lora) and b; None when none applies.
    fold_into: the layer's expert adapters, whose down shrink launch then runs this shrink too."""
    if not lora_wanted(ctx, slots):
        return None
    assert len(slots.bounds) == 2, "low_rank_lora: one slice"
    keys = ctx.lora.rows.keys
    if fold_into is not None:
        v = fold_into.fold_shrink(x=x, a=slots.a, keys=keys, glu=glu)
    else:
        v = lora_kernels.shrink(x=x, a=slots.a, rows=ctx.lora.rows, glu=glu, pdl=ctx.kernels.pdl)
    return lora_kernels.PairLowRank(keys, v, slots.b)


def out_lora(
    ctx: ForwardContext | None,
    slots: LoraProjection | None,
    y: torch.Tensor,
    x: torch.Tensor,
    layout: ParallelLayout,
    *,
    defer: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, lora_kernels.PairLowRank | None]:
    """A row-parallel output projection's adapters, then the all-reduce of the partial sums: y (the
    projection of x) reduced with its deltas in. defer: (that, None), or on one rank (y, its adapters
    in low-rank form) for the norm after it to add (norm.fused_add_rms_norm's low_rank)."""
    if defer and layout.tp_size == 1:
        return y, low_rank_lora(ctx, slots, x)
    out = all_reduce(add_lora(ctx, slots, y, x), layout)
    return (out, None) if defer else out


def expert_deltas(
    ctx: ForwardContext, slots: ExpertLoraSlots | None, hidden: torch.Tensor, expert_offset: int
) -> lora_kernels.ExpertDeltas | None:
    """The routed experts' adapters for the MoE op (moe.PairDeltas), or None (the base experts)."""
    if ctx.moe_lora_route is MoeLoraRoute.REFUSE:
        raise LoraError("this pass mixes adapters the MoE layers cannot fold (MoeLoraRoute.REFUSE)")
    if ctx.moe_lora_route is not MoeLoraRoute.FOLD or not lora_wanted(ctx, slots):
        return None
    return lora_kernels.ExpertDeltas(
        hidden=hidden, token_slots=ctx.lora.token_slots, weights=slots.weights, expert_offset=expert_offset,
        pdl=ctx.kernels.pdl,
    )  # fmt: skip


def _model_param(model: torch.nn.Module) -> torch.Tensor:
    """A parameter in the model's own dtype (FP8 projections hold float8 values: never one of those)."""
    return next(p for p in model.parameters() if p.dtype != torch.float8_e4m3fn)


def slot_rank(max_lora_rank: int) -> int:
    """The rank a slot holds: the limit rounded up to a power of two of at least 16 (the kernels' tiles)."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# Slots on the model
# ---------------------------------------------------------------------------------------------
def enable_lora(model: torch.nn.Module, *, max_loras: int, max_lora_rank: int, experts: bool = True) -> None:
    """Allocate every projection's adapter slots (zeros) in the model's dtype and device; `experts`:
    the routed experts' too (their memory is max_loras x rank x experts x (3 H + 3 I) a layer)."""
    rank = slot_rank(max_lora_rank)
    param = _model_param(model)
    opts = dict(dtype=param.dtype, device=param.device)
    groups: dict[tuple[int, str], list[LoraTarget]] = {}
    for t in model.lora_targets():
        if t.expert:
            continue
        groups.setdefault((id(t.owner), t.key), []).append(t)
    for targets in groups.values():
        owner, key = targets[0].owner, targets[0].key
        targets.sort(key=lambda t: t.row_range[0])
        bounds = [0]
        for t in targets:
            lo, hi = t.row_range
            assert lo == bounds[-1], f"{t.name}: the slices of {key} are not contiguous rows"
            bounds.append(hi)
        slots = LoraProjection(
            a=torch.zeros((max_loras, len(targets) * rank, targets[0].local_in), **opts),
            b=torch.zeros((max_loras, bounds[-1], rank), **opts),
            bounds=tuple(bounds),
            slices=tuple(t.name for t in targets),
            present=[False] * max_loras,
        )
        owner.lora_slots = {**owner.lora_slots, key: slots}
    if experts:
        blocks = {id(t.owner): t.owner for t in model.lora_targets() if t.expert}
        for block in blocks.values():  # the routed experts, w13 [E, 2I, H]
            e, inter2, h = block.w13.shape
            weights = ExpertLoraWeights(
                a13=torch.zeros((max_loras, e, 2 * rank, h), **opts),
                b13=torch.zeros((max_loras, e, inter2, rank), **opts),
                a2=torch.zeros((max_loras, e, rank, inter2 // 2), **opts),
                b2=torch.zeros((max_loras, e, h, rank), **opts),
            )
            block.lora_slots = {**block.lora_slots, "experts": ExpertLoraSlots(weights, [False] * max_loras)}


# ---------------------------------------------------------------------------------------------
# Adapter files
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterConfig:
    """What of adapter_config.json the forward needs: alpha (per module through alpha_pattern) and
    whether the scaling is alpha / sqrt(r) (rsLoRA) instead of alpha / r."""

    lora_alpha: float
    use_rslora: bool = False
    alpha_pattern: dict = field(default_factory=dict)

    def scaling(self, keys: tuple[str, ...], rank: int) -> float:
        """alpha / r (or / sqrt(r)) with alpha from the first alpha_pattern matching one of `keys` (PEFT
        matches a module's name, or module.parameter for a targeted parameter)."""
        alpha = self.lora_alpha
        for pattern, value in self.alpha_pattern.items():
            if any(re.match(rf"(.*\.)?({pattern})$", key) for key in keys):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """adapter_config.json of the adapter folder `path`, checked; errors name the file and field."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoraError(f"adapter path {_short(path)} is not a directory")
    if not file.is_file():
        raise LoraError(f"adapter file {_short(file)} is missing")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"adapter file {_short(file)} is not JSON: {str(e)[:80]}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter file {_short(file)} is not a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{_short(file)}: peft_type {str(peft_type)[:20]!r} is not LORA")
    for name in _VARIANTS:
        if cfg.get(name):
            raise LoraError(f"{_short(file)}: {name} is set; only plain LoRA (B A x) adapters are served")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoraError(f"{_short(file)}: bias / lora_bias: adapters with bias terms are not served")
    if cfg.get("fan_in_fan_out"):
        raise LoraError(f"{_short(file)}: fan_in_fan_out is set (Conv1D weights); not served")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"{_short(file)}: lora_alpha must be a number")
    patterns = cfg.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoraError(f"{_short(file)}: alpha_pattern must be an object")
    return AdapterConfig(float(alpha), bool(cfg.get("use_rslora", False)), dict(patterns))


def _short(path: Path | str, limit: int = 120) -> str:
    text = str(path)
    return repr(text if len(text) <= limit else "..." + text[-limit:])


@dataclass(frozen=True)
class AdapterTensor:
    """One A/B pair of an adapter file: its module name in the checkpoint's (text model's) naming and
    the two tensor names; `depth`: PEFT's nesting of targeted parameters (`base_layer.` count)."""

    module: str
    file_module: str  # as the file spells it (alpha_pattern matches this)
    a: str
    b: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    depth: int = 0


def read_adapter_tensors(path: str | Path) -> list[AdapterTensor]:
    """The A/B pairs of adapter_model.safetensors (headers only); errors name the file and tensor."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        bin_file = (Path(path) / "adapter_model.bin").is_file()
        extra = " (adapter_model.bin is not read: save with safe_serialization)" if bin_file else ""
        raise LoraError(f"adapter file {_short(file)} is missing{extra}")
    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise LoraError(f"adapter file {_short(file)} is not a safetensors file: {str(e)[:80]}") from None
    pairs: dict[tuple[str, int], dict[str, str]] = {}
    for key in shapes:
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+?)((?:\.base_layer)*)\.lora_([AB])\.weight", key)
        if m is None:
            raise LoraError(f"{_short(file)}: tensor {key[:100]!r} is not a LoRA A or B weight")
        depth = m.group(2).count(".base_layer")
        pairs.setdefault((m.group(1), depth), {})[m.group(3)] = key
    out = []
    for (module, depth), ab in sorted(pairs.items()):
        for half in "AB":
            if half not in ab:
                raise LoraError(f"{_short(file)}: module {module[:100]!r} has no lora_{half} weight")
        out.append(AdapterTensor(
            _canonical(module), module, ab["A"], ab["B"], shapes[ab["A"]], shapes[ab["B"]], depth,
        ))  # fmt: skip
    return out


def _canonical(module: str) -> str:
    """The text model's name of a module: composite checkpoints' `model.language_model.` -> `model.`."""
    for prefix, repl in (("model.language_model.", "model."), ("language_model.", "")):
        if module.startswith(prefix):
            return repl + module[len(prefix) :]
    return module


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter tensor pair matched to a target: its rank and scaling, and for the fused 3-D
    experts the expert count it packs and whether its gate_up is two blocks (`split`: PEFT's
    conversion of a gate_proj + up_proj adapter, A = [A_gate; A_up] and B block-diagonal, served as
    rank r / 2 per projection)."""

    tensor: AdapterTensor
    target: LoraTarget
    rank: int
    scaling: float
    experts: int = 1
    split: bool = False


def match_adapter(
    targets: Iterable[LoraTarget], path: str | Path, *, max_lora_rank: int, experts: bool = True
) -> list[AdapterEntry]:
    """Each A/B pair of the adapter at `path` matched to the model's targets and checked against the
    base shapes and the rank limit (headers only). Errors name the file and the tensor or field;
    `experts` False refuses adapters on the routed experts."""
    config = read_adapter_config(path)
    file = Path(path) / WEIGHTS_FILE
    by_name: dict[str, list[LoraTarget]] = {}
    for t in targets:
        by_name.setdefault(t.name, []).append(t)
    entries = []
    for tensor in read_adapter_tensors(path):
        if tensor.module.startswith(_IGNORED_PREFIXES):
            log.warning("adapter %s: %s is not part of the served text model; ignored", path, tensor.module)
            continue
        candidates = by_name.get(tensor.module)
        if not candidates:
            raise LoraError(f"{_short(file)}: tensor {tensor.a[:100]!r} targets no projection of the model")
        if len(tensor.a_shape) != 2 or len(tensor.b_shape) != 2:
            raise LoraError(f"{_short(file)}: tensor {tensor.a[:100]!r} is not 2-D")
        target, packed = _pick_target(candidates, tensor, file)
        if target.expert and not experts:
            raise LoraError(
                f"{_short(file)}: tensor {tensor.a[:100]!r} adapts the routed experts, and this engine runs "
                "with enable_expert_lora off"
            )
        rank_total = tensor.a_shape[0]
        if rank_total % packed or tensor.b_shape[1] != rank_total:
            raise LoraError(
                f"{_short(file)}: tensor {tensor.b[:100]!r} has shape {list(tensor.b_shape)}, its A "
                f"{list(tensor.a_shape)}: the ranks differ"
            )
        rank = rank_total // packed
        keys = (tensor.file_module, f"{tensor.file_module}.{_PARAM_NAMES.get(target.expert, 'weight')}")
        scaling = config.scaling(keys, rank)
        split = target.expert == "gate_up" and rank > max_lora_rank and rank % 2 == 0 and rank // 2 <= max_lora_rank
        if split and not _block_diagonal(file, tensor, packed):
            split = False
        if rank > max_lora_rank and not split:
            raise LoraError(
                f"{_short(file)}: rank {rank} of {tensor.module[:100]!r} exceeds max_lora_rank ({max_lora_rank})"
            )
        entries.append(AdapterEntry(tensor, target, rank // 2 if split else rank, scaling, packed, split))
    if not entries:
        raise LoraError(f"{_short(file)} holds no LoRA weights for this model")
    return entries


_PARAM_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}  # the fused experts' parameters


def _block_diagonal(file: Path, tensor: AdapterTensor, experts: int) -> bool:
    """Whether a fused gate_up B [2I, 2r * E] is block-diagonal per expert (gate rows on the first r
    ranks, up rows on the last r): read from the file, only for a rank over the limit."""
    with safe_open(str(file), framework="pt") as f:
        b = f.get_tensor(tensor.b)
    rows, rank = b.shape[0] // 2, b.shape[1] // (2 * experts)
    b = b.view(2 * rows, 2 * rank, experts)
    return bool((b[:rows, rank:] == 0).all() and (b[rows:, :rank] == 0).all())


def _pick_target(candidates: list[LoraTarget], tensor: AdapterTensor, file: Path) -> tuple[LoraTarget, int]:
    """The target a tensor pair adapts (the fused experts: gate_up or down, by the shapes) and how
    many experts its rank packs; a shape that fits none is an error naming the tensor."""
    a_in, b_out = tensor.a_shape[1], tensor.b_shape[0]
    for t in candidates:
        packed = 1
        if t.expert and t.expert_index is None:  # fused 3-D experts: A [r * E, in], B [out, r * E]
            packed = t.owner.num_experts
        if (b_out, a_in) == t.shape:
            return t, packed
    want = " or ".join(f"[{t.shape[0]}, r] x [r, {t.shape[1]}]" for t in candidates)
    raise LoraError(
        f"{_short(file)}: tensors {tensor.b[:100]!r} {list(tensor.b_shape)} and A {list(tensor.a_shape)} "
        f"do not match the base module (B x A must be {want})"
    )


# ---------------------------------------------------------------------------------------------
# Loading into slots
# ---------------------------------------------------------------------------------------------
@dataclass
class LoadedAdapter:
    """An adapter's tensors for this rank, on the host (a CPU cache keeps several): per target the
    A columns and B rows this rank uses, B scaled; `has_experts`: it adapts routed experts."""

    parts: list[tuple[LoraTarget, torch.Tensor, torch.Tensor]]
    has_experts: bool
    nbytes: int


def load_adapter(
    model: torch.nn.Module, path: str | Path, *, max_lora_rank: int, experts: bool = True
) -> LoadedAdapter:
    """Read this rank's share of the adapter at `path` (checked as match_adapter)."""
    entries = match_adapter(model.lora_targets(), path, max_lora_rank=max_lora_rank, experts=experts)
    dtype = _model_param(model).dtype
    parts = []
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for entry in entries:
            a = f.get_tensor(entry.tensor.a).to(torch.float32)
            b = f.get_tensor(entry.tensor.b).to(torch.float32) * entry.scaling
            parts += _rank_share(entry, a, b, dtype)
    nbytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b in parts)
    return LoadedAdapter(parts, any(t.expert for t, _, _ in parts), nbytes)


def _rank_share(entry: AdapterEntry, a: torch.Tensor, b: torch.Tensor, dtype) -> list:
    """[(target, A [r, K_local], B [rows, r])] this rank keeps of one tensor pair; the fused 3-D
    experts unpack into one part per local expert (target with its expert_index)."""
    t = entry.target
    if t.expert and t.expert_index is None:
        num = entry.experts
        r = a.shape[0] // num
        a_e = a.view(num, r, -1)  # expert e's A: rows e * r ..
        b_e = b.view(b.shape[0], r, num).permute(2, 0, 1)  # its B: columns e, e + E, ..
        out = []
        for local in range(t.owner.num_local_experts):
            e = t.owner.expert_start + local
            if entry.split:  # gate: the first r / 2 ranks and rows, up: the last
                half, rows = r // 2, b.shape[0] // 2
                for proj, ranks, out_rows in (
                    ("gate", slice(0, half), slice(0, rows)),
                    ("up", slice(half, r), slice(rows, None)),
                ):
                    sub = replace(t, expert=proj, expert_index=local)
                    out += _expert_share(sub, a_e[e, ranks], b_e[e, out_rows, ranks], dtype)
            else:
                out += _expert_share(replace(t, expert_index=local), a_e[e], b_e[e], dtype)
        return out
    if t.expert and t.expert_index < 0:
        return []  # another rank's expert
    if t.expert:
        return _expert_share(t, a, b, dtype)
    if t.cols is not None:
        first, count = t.cols
        a = a[:, first : first + count]
    else:  # B's rows where the weight's rows go (a fused layout interleaves them)
        lo, hi = t.row_range
        local = torch.zeros((hi - lo, b.shape[1]), dtype=b.dtype)
        for src, dst, n in t.rows:
            local[dst - lo : dst - lo + n] = b[src : src + n]
        b = local
    return [(t, a.to(dtype).contiguous(), b.to(dtype).contiguous())]


def _expert_share(t: LoraTarget, a: torch.Tensor, b: torch.Tensor, dtype) -> list:
    """One local expert's gate / up / down / gate_up / down pair: A columns and B rows of this rank's
    expert width (tensor parallel splits each expert's intermediate dim)."""
    block = t.owner
    i0, inter, total = block.inter_start, block.inter, block.total_inter
    if t.expert in ("gate", "up"):
        b = b[i0 : i0 + inter]
    elif t.expert == "gate_up":
        b = torch.cat([b[i0 : i0 + inter], b[total + i0 : total + i0 + inter]])
    else:  # down: the expert width is A's columns
        a = a[:, i0 : i0 + inter]
    return [(t, a.to(dtype).contiguous(), b.to(dtype).contiguous())]


def clear_slot(model: torch.nn.Module, slot: int) -> None:
    """Zero slot `slot` of every projection (no adapter)."""
    for slots in _all_slots(model):
        if isinstance(slots, LoraProjection):
            slots.a[slot].zero_()
            slots.b[slot].zero_()
        else:
            for w in slots.weights:
                w[slot].zero_()
        slots.present[slot] = False


def write_slot(model: torch.nn.Module, slot: int, adapter: LoadedAdapter) -> None:
    """Copy an adapter into slot `slot` of every projection (zero where it has no weights)."""
    clear_slot(model, slot)
    with torch.no_grad():
        for t, a, b in adapter.parts:
            r = a.shape[0]
            slots = t.owner.lora_slots["experts" if t.expert else t.key]
            if isinstance(slots, ExpertLoraSlots):
                _write_expert(slots, slot, t, a, b)
            else:
                j = slots.slices.index(t.name)
                rank = slots.b.shape[2]
                slots.a[slot, j * rank : j * rank + r].copy_(a)
                lo = t.row_range[0]
                slots.b[slot, lo : lo + b.shape[0], :r].copy_(b)
            slots.present[slot] = True


def _write_expert(slots: ExpertLoraSlots, slot: int, t: LoraTarget, a: torch.Tensor, b: torch.Tensor) -> None:
    w, e, r = slots.weights, t.expert_index, a.shape[0]
    rank, inter = w.a2.shape[2], w.a2.shape[3]
    if t.expert in ("gate", "gate_up"):
        w.a13[slot, e, :r].copy_(a)
    if t.expert in ("up", "gate_up"):
        w.a13[slot, e, rank : rank + r].copy_(a)
    if t.expert == "gate_up":
        w.b13[slot, e, :, :r].copy_(b)
    elif t.expert == "gate":
        w.b13[slot, e, :inter, :r].copy_(b)
    elif t.expert == "up":
        w.b13[slot, e, inter:, :r].copy_(b)
    else:
        w.a2[slot, e, :r].copy_(a)
        w.b2[slot, e, :, :r].copy_(b)


def _all_slots(model: torch.nn.Module) -> list:
    return [s for m in model.modules() for s in getattr(m, "lora_slots", NO_SLOTS).values()]


@contextmanager
def marked_present(model: torch.nn.Module, slots: Sequence[int]) -> Iterator[None]:
    """Inside the block, slots `slots` of every projection and expert block count as holding an
    adapter (their weights as they are, never written), so a pass naming them runs every adapter
    kernel; the flags are restored after (the start-up warm-up compiles the adapter kernels so)."""
    sets = _all_slots(model)
    saved = [list(s.present) for s in sets]
    try:
        for s in sets:
            for slot in slots:
                s.present[slot] = True
        yield
    finally:
        for s, flags in zip(sets, saved, strict=True):
            s.present[:] = flags


def slot_has_experts(model: torch.nn.Module, slot: int) -> bool:
    """Whether slot `slot` holds routed-expert adapter weights (the pass's MoE route folds them)."""
    return any(isinstance(s, ExpertLoraSlots) and s.present[slot] for s in _all_slots(model))


def randomize_slot(model: torch.nn.Module, slot: int, rank: int, seed: int = 0, scale: float = 0.02) -> None:
    """Fill slot `slot` of every projection and expert with a random rank-`rank` adapter, in place on
    the device (benchmarks: an adapter at a real model's shape without writing its file)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    clear_slot(model, slot)

    def fill(t: torch.Tensor) -> None:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32) * scale)

    with torch.no_grad():
        for slots in _all_slots(model):
            if isinstance(slots, LoraProjection):
                width = slots.b.shape[2]
                for j in range(len(slots.bounds) - 1):
                    fill(slots.a[slot, j * width : j * width + rank])
                fill(slots.b[slot, :, :rank])
            else:
                w = slots.weights
                width = w.a2.shape[2]
                for a in (w.a13[slot, :, :rank], w.a13[slot, :, width : width + rank], w.a2[slot, :, :rank]):
                    fill(a)
                fill(w.b13[slot, :, :, :rank])
                fill(w.b2[slot, :, :, :rank])
            slots.present[slot] = True
