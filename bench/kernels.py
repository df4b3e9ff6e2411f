"""Kernel benchmark: each Triton kernel at Qwen3.5-35B-A3B shapes against its reference (and fla
for GDN) in the same run, with an agreement check and the HBM floor.

    python -m deltaserve.bench.kernels [--only gdn,attention,moe,conv1d,norm,qsa] [--match graph] [--json out.json]

GPU only. Cases come from bench/kernels_<op>.py modules, each exposing `cases() -> list[Case]`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

OPS = ("gdn", "conv1d", "attention", "moe", "norm", "linear", "qsa")


def measure_copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), measured now."""
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3)


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(OPS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--match", default="", help="only cases whose op name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = measure_copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for op in args.only.split(","):
        module = importlib.import_module(f"deltaserve.bench.kernels_{op}")
        for case in module.cases():
            if args.match and not any(m in case.op for m in args.match.split(",")):
                continue
            err = case.check()
            ok = err <= case.tolerance
            row = {"op": case.op, "shape": case.shape, "max_err": err, "ok": ok, "target": case.target}
            row["ours_ms"] = triton.testing.do_bench(case.ours, warmup=25, rep=100, return_mode="median")
            if case.reference is not None:
                row["ref_ms"] = triton.testing.do_bench(case.reference, warmup=5, rep=20, return_mode="median")
                row["ref"] = case.reference_label
            if case.peer is not None:
                row["peer_ms"] = triton.testing.do_bench(case.peer, warmup=25, rep=100, return_mode="median")
                row["peer"] = case.peer_label
            if case.bytes_moved:
                row["floor_ms"] = case.bytes_moved / bandwidth * 1e3
                row["bw_frac"] = row["floor_ms"] / row["ours_ms"]
            if case.flops:
                row["tflops"] = case.flops / (row["ours_ms"] * 1e-3) / 1e12
            rows.append(row)
            print(_fmt(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bandwidth, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


def _fmt(r: dict) -> str:
    parts = [f"{r['op']:<22} {r['shape']:<34} ours {r['ours_ms']:.4f} ms"]
    if "ref_ms" in r:
        parts.append(f"{r['ref']} {r['ref_ms']:.4f} ms")
    if "peer_ms" in r:
        parts.append(f"{r['peer']} {r['peer_ms']:.4f} ms ({r['peer_ms'] / r['ours_ms']:.2f}x)")
    if "bw_frac" in r:
        parts.append(f"floor {r['floor_ms']:.4f} ms ({100 * r['bw_frac']:.0f}% of copy BW)")
    if "tflops" in r:
        parts.append(f"{r['tflops']:.0f} TFLOP/s")
    parts.append(f"err {r['max_err']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
