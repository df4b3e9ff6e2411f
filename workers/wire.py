"""The wire format of a pass: PassPlan and RunnerOutput as msgpack.

Arrays travel as raw little-endian bytes with their dtype and shape; every message carries a
version. Decoding checks the version, the fields, each array's byte count against its shape and the
plan's shapes against each other, so a malformed plan is rejected with a `WireError` naming the
problem instead of reaching a kernel.
"""

from __future__ import annotations

import struct
from dataclasses import asdict

import msgpack
import numpy as np

from .config import MAX_SPEC_TOKENS
from .plan import (
    GrammarSpec,
    LoraLoad,
    NewRequestData,
    PassPlan,
    PoolSizes,
    RunnerOutput,
    SamplingSpec,
    TokenLogprobs,
)

# 5: speculative decoding (verify rows, drafts); 6: LoRA slots and loads; 7: structured output
# (grammars to compile, grammars ready, grammar errors)
WIRE_VERSION = 7

# A plan's arrays, in buffer order, with their lengths in terms of T tokens, N rows and P pages per
# block table. One buffer per dtype keeps decoding to three `frombuffer` calls and some slicing
# (one record per array cost ~10x more on the worker's side of every pass).
_INT32_FIELDS = (
    ("input_ids", "T"),
    ("positions", "T"),
    ("query_start_loc", "N+1"),
    ("seq_lens", "N"),
    ("state_slots", "N"),
    ("block_tables", "N*P"),
    ("next_prompt_token", "N"),  # optional
    ("input_from_prev", "N"),  # optional
    ("lora_slots", "N"),  # optional
)
_INT64_FIELDS = (("slot_mapping", "T"),)
_BOOL_FIELDS = (("has_initial_state", "N"), ("sample_rows", "N"), ("prompt_logprob_rows", "N"), ("draft_rows", "N"))
_OPTIONAL = ("next_prompt_token", "input_from_prev", "lora_slots", "draft_rows")
_BUFFERS = (("int32", np.dtype("<i4"), _INT32_FIELDS), ("int64", np.dtype("<i8"), _INT64_FIELDS),
            ("bool", np.dtype("|b1"), _BOOL_FIELDS))  # fmt: skip
_PLAN_SCALARS = ("pass_id", "req_ids", "num_decode_rows", "num_tokens", "max_pages", "num_spec_tokens")
# optional [M, width] int32 tables, each sent as (M, raw bytes)
_TABLES = (("slot_saves", 2), ("slot_restores", 2), ("page_copies", 2), ("captures", 3))
_I32 = np.dtype("<i4")


class WireError(ValueError):
    """A message that is not a valid pass plan or runner output."""


def encode_plan(plan: PassPlan) -> bytes:
    n, t = len(plan.req_ids), plan.num_tokens
    if plan.block_tables.ndim != 2:
        raise WireError(f"plan field 'block_tables' has shape {plan.block_tables.shape}, expected ({n}, pages)")
    p = plan.block_tables.shape[1]
    body = {"pass_id": plan.pass_id, "req_ids": plan.req_ids, "num_decode_rows": plan.num_decode_rows,
            "num_tokens": t, "max_pages": p, "num_spec_tokens": plan.num_spec_tokens}  # fmt: skip
    present = []
    shapes = {"T": (t,), "N": (n,), "N+1": (n + 1,), "N*P": (n, p)}
    for key, dtype, layout in _BUFFERS:
        parts = []
        for name, rule in layout:
            a = getattr(plan, name)
            if a is None:
                continue
            if a.shape != shapes[rule]:
                raise WireError(f"plan field '{name}' has shape {a.shape}, expected {shapes[rule]}")
            if name in _OPTIONAL:
                present.append(name)
            parts.append(a.reshape(-1))
        body[key] = np.concatenate(parts).astype(dtype, copy=False).tobytes()
    body["optional"] = present
    tables = {}
    for name, width in _TABLES:
        a = getattr(plan, name)
        if a is None:
            continue
        if a.ndim != 2 or a.shape[1] != width:
            raise WireError(f"plan field '{name}' has shape {a.shape}, expected (M, {width})")
        tables[name] = [int(a.shape[0]), a.astype(_I32, copy=False).tobytes()]
    if tables:
        body["tables"] = tables
    if plan.lora_loads:
        body["lora_loads"] = [[x.slot, x.key, x.name, x.path] for x in plan.lora_loads]
    body["new_requests"] = [asdict(r) for r in plan.new_requests]
    body["finished_req_ids"] = plan.finished_req_ids
    if plan.grammars:
        body["grammars"] = [asdict(g) for g in plan.grammars]
    return msgpack.packb({"v": WIRE_VERSION, "kind": "plan", "body": body}, use_bin_type=True)


def decode_plan(blob: bytes) -> PassPlan:
    body = _open(blob, "plan")
    try:
        for name in (*_PLAN_SCALARS, "int32", "int64", "bool"):
            if name not in body:
                raise WireError(f"plan field '{name}' is missing")
        t, p, req_ids = body["num_tokens"], body["max_pages"], body["req_ids"]
        if not (isinstance(t, int) and isinstance(p, int) and t >= 0 and p >= 0 and isinstance(req_ids, list)):
            raise WireError("plan fields 'num_tokens', 'max_pages' and 'req_ids' must be counts and a list")
        n = len(req_ids)
        present = body.get("optional", ())
        lengths = {"T": t, "N": n, "N+1": n + 1, "N*P": n * p}
        kwargs = {"pass_id": body["pass_id"], "req_ids": req_ids, "num_decode_rows": body["num_decode_rows"],
                  "num_spec_tokens": body["num_spec_tokens"]}  # fmt: skip
        for key, dtype, layout in _BUFFERS:
            data = body[key]
            flat = np.frombuffer(data, dtype=dtype) if isinstance(data, bytes) else None
            at = 0
            for name, rule in layout:
                if name in _OPTIONAL and name not in present:
                    continue
                size = lengths[rule]
                kwargs[name] = flat[at : at + size] if flat is not None else None
                at += size
            if flat is None or flat.shape[0] != at:
                _buffer_error(key, data, dtype, at, layout, present, t, n, p)
        kwargs["block_tables"] = kwargs["block_tables"].reshape(n, p)
        tables = body.get("tables", {})
        for name, width in _TABLES:
            if name not in tables:
                continue
            rows, data = tables[name]
            if not (isinstance(rows, int) and isinstance(data, bytes) and len(data) == rows * width * 4):
                raise WireError(f"plan field '{name}' is not {rows!r} rows of {width} int32")
            kwargs[name] = np.frombuffer(data, dtype=_I32).reshape(rows, width)
        kwargs["lora_loads"] = [LoraLoad(int(a), int(b), str(c), str(d)) for a, b, c, d in body.get("lora_loads", ())]
        kwargs["new_requests"] = [
            NewRequestData(
                r["req_id"], list(r["prompt_token_ids"]), list(r["output_token_ids"]), SamplingSpec(**r["sampling"])
            )
            for r in body.get("new_requests", ())
        ]
        kwargs["finished_req_ids"] = list(body.get("finished_req_ids", ()))
        kwargs["grammars"] = [GrammarSpec(**g) for g in body.get("grammars", ())]
        plan = PassPlan(**kwargs)
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed plan: {e}") from e
    check_plan_values(plan)
    return plan


def _buffer_error(key, data, dtype, want, layout, present, t, n, p) -> None:
    got = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
    names = ", ".join(name for name, _ in layout if name not in _OPTIONAL or name in present)
    raise WireError(
        f"plan buffer '{key}' ({names}) holds {got}, expected {want * dtype.itemsize} for {t} tokens, {n} rows"
        f" and {p} pages"
    )


# ---- plan checks ----------------------------------------------------------------------------------
# Every check a plan passes before a worker runs it: `decode_plan` runs `check_plan_values`; the
# runner runs `check_plan_ranges` and `check_prev_ids`, which need what the rank holds.


def check_plan_values(plan: PassPlan) -> None:
    """What the shapes cannot say: row boundaries rise from 0 to the token count, the decode rows
    come first, and rows that read the previous pass's ids are one-token decode rows."""
    n, t = plan.num_rows, plan.num_tokens
    starts = plan.query_start_loc
    if not isinstance(plan.num_decode_rows, int) or not 0 <= plan.num_decode_rows <= n:
        raise WireError(f"plan field 'num_decode_rows' is {plan.num_decode_rows} for {n} rows")
    if n and (starts[0] != 0 or starts[-1] != t or np.diff(starts).min() < 1):
        raise WireError("plan field 'query_start_loc' must rise from 0 to the token count in steps >= 1")
    if plan.input_from_prev is not None and n:
        _check_prev_rows(plan)
    check_spec_rows(plan)


def _check_prev_rows(plan: PassPlan) -> None:
    from_prev = plan.input_from_prev
    if from_prev.min() < -1:
        raise WireError("plan field 'input_from_prev' holds values below -1")
    rows = from_prev >= 0
    if (np.diff(plan.query_start_loc)[rows] != 1).any() or rows[plan.num_decode_rows :].any():
        raise WireError("plan field 'input_from_prev' names a row that is not a one-token decode row")


def check_spec_rows(plan: PassPlan) -> None:
    """Verify rows (num_spec_tokens = k > 0): the decode rows, k + 1 tokens each, all sampling and
    drafting; k within what the verify tables hold."""
    k, nd = plan.num_spec_tokens, plan.num_decode_rows
    if not isinstance(k, int) or not 0 <= k <= MAX_SPEC_TOKENS:
        raise WireError(f"plan field 'num_spec_tokens' is {k!r}; it must be in 0..{MAX_SPEC_TOKENS}")
    if not k:
        return
    if plan.draft_rows is None or plan.next_prompt_token is None:
        raise WireError("a plan with verify rows needs the fields 'draft_rows' and 'next_prompt_token'")
    if nd < 1 or (np.diff(plan.query_start_loc)[:nd] != k + 1).any():
        raise WireError(f"plan field 'num_spec_tokens' is {k}: its decode rows must hold {k + 1} tokens each")
    if not (plan.sample_rows[:nd].all() and plan.draft_rows[:nd].all()):
        raise WireError("a verify row must sample and draft")
    if plan.input_from_prev is not None and (plan.input_from_prev >= 0).any():
        raise WireError("plan field 'input_from_prev' cannot be used with verify rows")


def check_spec_engine(plan: PassPlan, num_speculative_tokens: int) -> None:
    """A plan's verify rows and drafting rows against the rank's speculative decoding (k drafts, or 0:
    none)."""
    k = num_speculative_tokens
    if plan.num_spec_tokens and plan.num_spec_tokens != k:
        raise WireError(f"plan field 'num_spec_tokens' is {plan.num_spec_tokens}; this engine verifies {k}")
    if not k and plan.draft_rows is not None and plan.draft_rows.any():
        raise WireError("plan field 'draft_rows' names rows, but this engine has no speculative decoding")


def check_plan_ranges(plan: PassPlan, sizes: PoolSizes, vocab_size: int, num_lora_slots: int = 0) -> None:
    """Indices that would address memory outside the pools (or the vocabulary, or the adapter slots)
    are rejected before any kernel runs."""

    def out_of(name: str, a: np.ndarray, hi: int, lo: int = 0) -> None:
        if a.size and (a.min() < lo or a.max() >= hi):
            raise WireError(f"plan field '{name}' holds values outside [{lo}, {hi})")

    out_of("input_ids", plan.input_ids, vocab_size)
    out_of("block_tables", plan.block_tables, sizes.num_blocks)
    out_of("slot_mapping", plan.slot_mapping, sizes.num_blocks * sizes.block_size, lo=-1)
    out_of("state_slots", plan.state_slots, sizes.num_slots)
    out_of("seq_lens", plan.seq_lens, plan.block_tables.shape[1] * sizes.block_size + 1, lo=1)
    running, snapshots = (0, sizes.num_slots), (sizes.num_slots, sizes.total_slots)
    for name, (src, dst) in (("slot_saves", (running, snapshots)), ("slot_restores", (snapshots, running))):
        pairs = getattr(plan, name)
        if pairs is not None and len(pairs):
            out_of(name, pairs[:, 0], src[1], lo=src[0])
            out_of(name, pairs[:, 1], dst[1], lo=dst[0])
            if len(set(pairs[:, 1].tolist())) != len(pairs):
                raise WireError(f"plan field '{name}' names a destination twice")
    if plan.page_copies is not None and len(plan.page_copies):
        out_of("page_copies", plan.page_copies, sizes.num_blocks)
    if plan.lora_slots is not None:
        out_of("lora_slots", plan.lora_slots, num_lora_slots, lo=-1)
    for load in plan.lora_loads:
        if not 0 <= load.slot < num_lora_slots:
            raise WireError(f"plan field 'lora_loads' names slot {load.slot} outside [0, {num_lora_slots})")
    if plan.captures is not None and len(plan.captures):
        rows = plan.captures[:, 0]
        out_of("captures", rows, plan.num_rows, lo=plan.num_decode_rows)
        out_of("captures", plan.captures[:, 2], sizes.total_slots, lo=sizes.num_slots)
        starts = plan.query_start_loc
        if (plan.captures[:, 1] < 0).any() or (plan.captures[:, 1] > starts[rows + 1] - starts[rows]).any():
            raise WireError("plan field 'captures' holds an offset outside its row's chunk")


def check_prev_ids(plan: PassPlan, held_pass_id: int | None, held_count: int) -> bool:
    """Whether the plan reads decode input ids from the previous pass's sampled ids (`input_from_prev`),
    checked against what the rank holds: the sampled ids of pass `held_pass_id` (None: none), `held_count`
    of them."""
    from_prev = plan.input_from_prev
    if from_prev is None or not (from_prev >= 0).any():
        return False
    if held_pass_id is None or held_pass_id != plan.pass_id - 1:
        what = "none" if held_pass_id is None else f"those of pass {held_pass_id}"
        raise WireError(
            f"plan field 'input_from_prev' reads pass {plan.pass_id - 1}'s sampled ids; this rank holds {what}"
        )
    if from_prev.max() >= held_count:
        raise WireError(f"plan field 'input_from_prev' holds values outside [-1, {held_count})")
    _check_prev_rows(plan)
    return True


def _logprobs_record(lp: TokenLogprobs) -> dict:
    return {
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "rank": lp.rank,
        "top_ids": lp.top_ids,
        "top_logprobs": lp.top_logprobs,
    }


def encode_output(out: RunnerOutput) -> bytes:
    # built by hand: dataclasses.asdict deep-copies and costs more than the rest of the pass's wire work
    body = {
        "pass_id": out.pass_id,
        "req_ids": out.req_ids,
        "sampled_token_ids": out.sampled_token_ids,
        "logprobs": {k: _logprobs_record(v) for k, v in out.logprobs.items()},
        "prompt_logprobs": {k: [_logprobs_record(e) for e in v] for k, v in out.prompt_logprobs.items()},
        "extra_token_ids": out.extra_token_ids,
        "extra_logprobs": {k: [_logprobs_record(e) for e in v] for k, v in out.extra_logprobs.items()},
        "draft_token_ids": out.draft_token_ids,
        "forward_time_s": out.forward_time_s,
        "device_s": [out.device_busy_s, out.device_gap_s],
    }
    if out.grammars_ready or out.grammar_errors:
        body["grammars"] = [out.grammars_ready, out.grammar_errors]
    return msgpack.packb({"v": WIRE_VERSION, "kind": "output", "body": body}, use_bin_type=True)


def decode_output(blob: bytes) -> RunnerOutput:
    body = _open(blob, "output")
    try:
        ready, errors = body.get("grammars", ({}, {}))
        return RunnerOutput(
            pass_id=body["pass_id"],
            req_ids=list(body["req_ids"]),
            sampled_token_ids=list(body["sampled_token_ids"]),
            logprobs={k: TokenLogprobs(**v) for k, v in body["logprobs"].items()},
            prompt_logprobs={k: [TokenLogprobs(**e) for e in v] for k, v in body["prompt_logprobs"].items()},
            extra_token_ids={k: list(v) for k, v in body["extra_token_ids"].items()},
            extra_logprobs={k: [TokenLogprobs(**e) for e in v] for k, v in body["extra_logprobs"].items()},
            draft_token_ids={k: list(v) for k, v in body["draft_token_ids"].items()},
            forward_time_s=body["forward_time_s"],
            device_busy_s=body["device_s"][0],
            device_gap_s=body["device_s"][1],
            grammars_ready=dict(ready),
            grammar_errors=dict(errors),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed runner output: {e}") from e


def _open(blob: bytes, kind: str) -> dict:
    try:
        msg = msgpack.unpackb(blob, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise WireError(f"not a msgpack message: {e}") from e
    if not isinstance(msg, dict) or "v" not in msg:
        raise WireError("message has no version field")
    if msg["v"] != WIRE_VERSION:
        raise WireError(f"wire version {msg['v']!r} is not {WIRE_VERSION}")
    if msg.get("kind") != kind or not isinstance(msg.get("body"), dict):
        raise WireError(f"message is not a {kind}")
    return msg["body"]


# ---- shared-memory reply frames -----------------------------------------------------------------
# A worker's reply to one pass over the ring: a status byte, then (ok) the worker's stage stamps and
# rank 0's encoded RunnerOutput, or (error) the traceback. The stamps are `time.perf_counter()`
# values, which on Linux read CLOCK_MONOTONIC and so compare across the processes of one host.
REPLY_STAMPS = ("plan_read", "plan_decoded", "launched", "reply_started", "resolved", "encoded")
_STAMPS = struct.Struct(f"<{len(REPLY_STAMPS)}d")


def encode_reply(output_blob: bytes, stamps: tuple[float, ...]) -> bytes:
    """An ok reply: `output_blob` is rank 0's `encode_output` bytes (empty on other ranks)."""
    return b"\0" + _STAMPS.pack(*stamps) + output_blob


def encode_error_reply(text: str) -> bytes:
    return b"\1" + text.encode()


def decode_reply(frame: bytes) -> tuple[bool, tuple[float, ...], bytes]:
    """(ok, stamps, payload): payload is the output blob when ok, else the error text's bytes."""
    if frame[:1] == b"\0" and len(frame) >= 1 + _STAMPS.size:
        return True, _STAMPS.unpack_from(frame, 1), frame[1 + _STAMPS.size :]
    if frame[:1] == b"\1":
        return False, (), frame[1:]
    raise WireError(f"reply frame: unknown status byte {frame[:1]!r} ({len(frame)} bytes)")


def rerun_codec(
    *,
    plan: PassPlan | None = None,
    plan_blob: bytes | None = None,
    output: RunnerOutput | None = None,
    output_blob: bytes | None = None,
) -> bool:
    """Encode / decode whichever of these are given again, results dropped: a poller's warm-up, so
    that the next pass's codec work runs from warm CPU caches. False if one raised (it never should:
    each was coded once already); the caller then drops its inputs."""
    try:
        if plan is not None:
            encode_plan(plan)
        if plan_blob is not None:
            decode_plan(plan_blob)
        if output is not None:
            encode_output(output)
        if output_blob is not None:
            decode_output(output_blob)
    except Exception:
        return False
    return True
