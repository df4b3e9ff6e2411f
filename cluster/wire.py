"""The wire format of a pass: PassPlan and RunnerOutput as msgpack.

Arrays travel as raw little-endian bytes with their dtype and shape; every message carries a
version. Decoding checks the version, the fields, each array's byte count against its shape and the
plan's shapes against each other, so a malformed plan is rejected with a `WireError` naming the
problem instead of reaching a kernel.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, fields

import msgpack
import numpy as np

from .plan import NewRequestData, PassPlan, RunnerOutput, SamplingSpec, TokenLogprobs

WIRE_VERSION = 2  # 2: PassPlan.input_from_prev (async scheduling)
_ARRAY_FIELDS = {
    "input_ids": "<i4",
    "positions": "<i4",
    "slot_mapping": "<i8",
    "query_start_loc": "<i4",
    "seq_lens": "<i4",
    "block_tables": "<i4",
    "state_slots": "<i4",
    "has_initial_state": "|b1",
    "sample_rows": "|b1",
    "prompt_logprob_rows": "|b1",
    "next_prompt_token": "<i4",
    "input_from_prev": "<i4",
}


_NP_DTYPES = {name: np.dtype(name) for name in set(_ARRAY_FIELDS.values())}
_PLAN_FIELDS = [f.name for f in fields(PassPlan)]


class WireError(ValueError):
    """A message that is not a valid pass plan or runner output."""


def _pack_array(a: np.ndarray, dtype: str) -> dict:
    a = np.ascontiguousarray(a, dtype=np.dtype(dtype))
    return {"dtype": dtype, "shape": list(a.shape), "data": a.tobytes()}


def _unpack_array(name: str, obj) -> np.ndarray:
    if not isinstance(obj, dict) or len(obj) != 3:
        raise WireError(f"plan field '{name}' is not an array record")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if dtype != _ARRAY_FIELDS[name]:
        raise WireError(f"plan field '{name}' has dtype {dtype!r}, expected {_ARRAY_FIELDS[name]!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WireError(f"plan field '{name}' has a bad shape {shape!r}")
    np_dtype = _NP_DTYPES[dtype]
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * np_dtype.itemsize:
        raise WireError(
            f"plan field '{name}' holds {len(data) if isinstance(data, bytes) else '?'} bytes "
            f"for shape {shape} of {dtype}"
        )
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)


def encode_plan(plan: PassPlan) -> bytes:
    body = {}
    for f in fields(PassPlan):
        value = getattr(plan, f.name)
        if f.name in _ARRAY_FIELDS:
            body[f.name] = None if value is None else _pack_array(value, _ARRAY_FIELDS[f.name])
        elif f.name == "new_requests":
            body[f.name] = [asdict(r) for r in value]
        else:
            body[f.name] = value
    return msgpack.packb({"v": WIRE_VERSION, "kind": "plan", "body": body}, use_bin_type=True)


def decode_plan(blob: bytes) -> PassPlan:
    body = _open(blob, "plan")
    try:
        kwargs = {}
        for name in _PLAN_FIELDS:
            if name not in body:
                if name in ("new_requests", "finished_req_ids", "next_prompt_token", "input_from_prev"):
                    continue
                raise WireError(f"plan field '{name}' is missing")
            value = body[name]
            if name in _ARRAY_FIELDS:
                kwargs[name] = None if value is None else _unpack_array(name, value)
            elif name == "new_requests":
                kwargs[name] = [
                    NewRequestData(
                        r["req_id"],
                        list(r["prompt_token_ids"]),
                        list(r["output_token_ids"]),
                        SamplingSpec(**r["sampling"]),
                    )
                    for r in value
                ]
            else:
                kwargs[name] = value
        plan = PassPlan(**kwargs)
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed plan: {e}") from e
    check_plan_shapes(plan)
    return plan


def check_plan_shapes(plan: PassPlan) -> None:
    """The arrays of a plan agree with each other (rows N, tokens T)."""
    n, t = len(plan.req_ids), plan.input_ids.shape[0] if plan.input_ids.ndim == 1 else -1
    if t < 0:
        raise WireError("plan field 'input_ids' must be 1-D")
    expect = {
        "positions": (t,),
        "slot_mapping": (t,),
        "query_start_loc": (n + 1,),
        "seq_lens": (n,),
        "state_slots": (n,),
        "has_initial_state": (n,),
        "sample_rows": (n,),
        "prompt_logprob_rows": (n,),
    }
    for name, shape in expect.items():
        if getattr(plan, name).shape != shape:
            raise WireError(f"plan field '{name}' has shape {getattr(plan, name).shape}, expected {shape}")
    if plan.block_tables.ndim != 2 or plan.block_tables.shape[0] != n:
        raise WireError(f"plan field 'block_tables' has shape {plan.block_tables.shape}, expected ({n}, pages)")
    if plan.next_prompt_token is not None and plan.next_prompt_token.shape != (n,):
        raise WireError(f"plan field 'next_prompt_token' has shape {plan.next_prompt_token.shape}, expected ({n},)")
    if plan.input_from_prev is not None:
        if plan.input_from_prev.shape != (n,):
            raise WireError(f"plan field 'input_from_prev' has shape {plan.input_from_prev.shape}, expected ({n},)")
        if plan.input_from_prev.size and plan.input_from_prev.min() < -1:
            raise WireError("plan field 'input_from_prev' holds values below -1")
    starts = plan.query_start_loc
    if n and (starts[0] != 0 or starts[-1] != t or (np.diff(starts) < 1).any()):
        raise WireError("plan field 'query_start_loc' must rise from 0 to the token count in steps >= 1")
    if not 0 <= plan.num_decode_rows <= n:
        raise WireError(f"plan field 'num_decode_rows' is {plan.num_decode_rows} for {n} rows")
    if plan.input_from_prev is not None and n:
        rows = plan.input_from_prev >= 0
        if (np.diff(starts)[rows] != 1).any() or rows[plan.num_decode_rows :].any():
            raise WireError("plan field 'input_from_prev' names a row that is not a one-token decode row")


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
        "forward_time_s": out.forward_time_s,
    }
    return msgpack.packb({"v": WIRE_VERSION, "kind": "output", "body": body}, use_bin_type=True)


def decode_output(blob: bytes) -> RunnerOutput:
    body = _open(blob, "output")
    try:
        return RunnerOutput(
            pass_id=body["pass_id"],
            req_ids=list(body["req_ids"]),
            sampled_token_ids=list(body["sampled_token_ids"]),
            logprobs={k: TokenLogprobs(**v) for k, v in body["logprobs"].items()},
            prompt_logprobs={k: [TokenLogprobs(**e) for e in v] for k, v in body["prompt_logprobs"].items()},
            forward_time_s=body["forward_time_s"],
        )
    except (KeyError, TypeError) as e:
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
