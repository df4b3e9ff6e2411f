"""The committed stubs are what scripts/gen-protos makes of the .proto files, and the proto's
SamplingParams carries every field of deltaserve's."""

# test phase: parallel (its child process generates stubs into a temporary folder)

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from deltaserve import SamplingParams
from deltaserve.protos import generation_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"

# the generator's own version: a newer grpcio-tools is not a schema change
_VERSION_STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(.*?^\)$", re.M | re.S),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
]


def _without_version_stamps(text: str) -> str:
    for pattern in _VERSION_STAMPS:
        text = pattern.sub("<version>", text)
    return text


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-protos"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    generated = sorted(p.name for p in tmp_path.iterdir())
    assert generated, "scripts/gen-protos generated nothing"
    committed = sorted(p.name for p in PROTOS.iterdir() if "_pb2" in p.name and p.suffix in (".py", ".pyi"))
    assert committed == generated, "stubs without a .proto, or a .proto without stubs: run scripts/gen-protos"
    for name in generated:
        fresh = _without_version_stamps((tmp_path / name).read_text())
        assert _without_version_stamps((PROTOS / name).read_text()) == fresh, (
            f"protos/{name} is stale: run scripts/gen-protos"
        )


def test_grpc_stubs_import_through_the_package():
    from deltaserve.protos import generation_pb2_grpc

    assert generation_pb2_grpc.generation__pb2 is generation_pb2


def test_proto_sampling_params_has_every_field():
    # output_kind shapes the Python async API's outputs; a Generate stream always sends each step's tokens
    proto_fields = set(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert proto_fields == {f.name for f in dataclasses.fields(SamplingParams)} - {"output_kind"}
