"""The kernel half's structure: kernel choices read once (no environment read under layers/ but
through the options module) and handed to the kernels as arguments; no kernel source over 700
lines; the README's variables are the registry's; device tile pickers stay within a device's
shared memory."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from passes import Sequences

from deltaserve import envs
from deltaserve.layers.kernels import attention as attn_kernels
from deltaserve.layers.kernels import conv1d as conv_kernels
from deltaserve.layers.kernels import gdn as gdn_kernels
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels import norm as norm_kernels
from deltaserve.layers.kernels import rotary as rotary_kernels
from deltaserve.layers.kernels.device import H200, SMEM_SCRATCH, DeviceInfo, device_info, tuned_for
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ROOT / "layers"
OPTIONS = LAYERS / "kernels" / "options.py"


def _reads_environment(tree: ast.AST) -> list[str]:
    """The places a module reads the environment: os.environ / os.getenv / environ / getenv, and
    deltaserve.envs.read."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"line {node.lineno}: from os import {a.name}" for a in node.names if "env" in a.name]
        elif isinstance(node, ast.Attribute) and node.attr == "read" and getattr(node.value, "id", "") == "envs":
            found.append(f"line {node.lineno}: envs.read")
    return found


def test_only_the_options_module_reads_the_environment_under_layers():
    readers = {}
    for path in sorted(LAYERS.rglob("*.py")):
        places = _reads_environment(ast.parse(path.read_text(), str(path)))
        if places:
            readers[str(path.relative_to(ROOT))] = places
    assert set(readers) == {str(OPTIONS.relative_to(ROOT))}, readers
    assert any("envs.read" in place for place in readers[str(OPTIONS.relative_to(ROOT))])


def test_no_kernel_source_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in LAYERS.joinpath("kernels").rglob("*.py") if (n := _lines(p)) > 700}
    assert not long, long


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_readme_lists_each_variable_of_the_registry_once():
    readme = (ROOT / "README.md").read_text()
    assert envs.markdown_table() in readme, "README's table differs from envs.markdown_table(): regenerate it"
    named = re.findall(r"DELTASERVE_[A-Z0-9_]+", readme)
    assert sorted(named) == sorted(envs.ENV_VARS), "each registered variable once, and no other"


def test_kernel_option_defaults_are_the_registry_defaults():
    assert KernelOptions.from_env({}) == KernelOptions()
    for f in KernelOptions.__dataclass_fields__.values():
        assert f.metadata["env"] in envs.ENV_VARS


# --- the options reach the kernels ----------------------------------------------------------------

OPS = {
    attn_kernels: ("write_kv_cache", "paged_attention", "paged_decode_attention"),
    conv_kernels: ("causal_conv1d_varlen", "causal_conv1d_update"),
    gdn_kernels: ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gdn_gating", "fused_gdn_decode"),
    linear_kernels: ("linear", "rms_norm_linear"),
    moe_kernels: ("route_topk_softmax", "fused_moe", "routed_moe"),
    norm_kernels: ("rms_norm", "fused_add_rms_norm", "gated_rms_norm", "embed_rms_norm"),
    rotary_kernels: ("qk_norm_rope",),
}


@pytest.fixture
def op_calls(monkeypatch) -> list[tuple[str, dict]]:
    """Every kernel op the layers call, recorded as (name, keyword arguments) and then run; an op
    that takes `pdl` must be given it (its default would hide a layer that forgets it)."""
    calls = []
    for module, names in OPS.items():
        for name in names:
            real = getattr(module, name)
            takes_pdl = "pdl" in inspect.signature(real).parameters

            def spy(*args, _real=real, _name=name, _takes_pdl=takes_pdl, **kwargs):
                # ops calling ops inside the kernel packages (the CPU references) are not the layers'
                if Path(sys._getframe(1).f_code.co_filename).parent.parent.name != "kernels":
                    assert not _takes_pdl or "pdl" in kwargs, f"{_name} called without pdl"
                    calls.append((_name, kwargs))
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, name, functools.wraps(real)(spy))
    return calls


def _decode_passes(path, kernels: KernelOptions) -> list[torch.Tensor]:
    """A prefill of three sequences, then two decode passes over them, with these kernel options."""
    seqs = Sequences(load_model(path), kernels=kernels)
    for s in "abc":
        seqs.add(s)
    out = seqs.run([("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])])
    for step in range(2):
        out += seqs.run([(s, [20 + step]) for s in "abc"])
    return out


def test_options_reach_every_kernel_op(tiny_checkpoints, op_calls):
    """Each op the model calls gets the pass's options: pdl everywhere it launches, the row GEMV
    switch and tiles in every projection, the routing cut in the MoE op; the GDN layer's fused
    decode op runs only up to fused_gdn_max_seqs sequences."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    tiles = KernelOptions.from_env({"DELTASERVE_ROW_TILES": "64x32:2x4"}).row_tiles
    opts = KernelOptions(
        pdl=False,
        row_gemv=False,
        row_tiles=tiles,
        route_in_up_max_tokens=0,
        fused_gdn_max_seqs=0,
        few_rows_gemv=0,
        few_rows_norm=False,
    )
    _decode_passes(path, opts)
    names = {name for name, _ in op_calls}
    assert {"routed_moe", "fused_recurrent_gated_delta_rule", "paged_decode_attention", "embed_rms_norm"} <= names
    assert "fused_gdn_decode" not in names  # fused_gdn_max_seqs = 0: the three separate ops
    for name, kwargs in op_calls:
        assert kwargs.get("pdl", False) is False, name
        if name in ("linear", "rms_norm_linear"):
            assert kwargs["row_gemv"] is False and kwargs["row_tiles"] == tiles and kwargs["few_rows"] == 0, name
        if name == "rms_norm_linear":
            assert kwargs["few_rows_norm"] is False
        if name == "routed_moe":
            assert kwargs["route_in_up_max_tokens"] == 0
    op_calls.clear()
    _decode_passes(path, KernelOptions())
    assert ("fused_gdn_decode" in {name for name, _ in op_calls}) and all(
        kwargs.get("pdl", True) is True for _, kwargs in op_calls
    )
    routed = [kwargs for name, kwargs in op_calls if name == "routed_moe"]
    assert routed and all(k["route_in_up_max_tokens"] == KernelOptions().route_in_up_max_tokens for k in routed)


def test_options_do_not_change_the_cpu_results(tiny_checkpoints):
    """On CPU the options choose among kernels only on CUDA: the logits are the same bits."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    off = KernelOptions(pdl=False, row_gemv=False, route_in_up_max_tokens=0, fused_gdn_max_seqs=0)
    for got, want in zip(_decode_passes(path, off), _decode_passes(path, KernelOptions()), strict=True):
        assert torch.equal(got, want)


def test_route_in_up_max_tokens_zero_launches_the_router(device, monkeypatch):
    """The Triton MoE (interpreted on CPU): with route_in_up_max_tokens = 0 a one-token batch takes
    the router kernel; at 1 it routes inside the up GEMV (no router launch)."""
    from deltaserve.layers.kernels.moe import triton_moe

    launched = []
    route = triton_moe.route_topk_softmax
    monkeypatch.setattr(triton_moe, "route_topk_softmax", lambda **kw: launched.append(1) or route(**kw))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 16, generator=g).to(device)
    w13 = (torch.randn(4, 16, 16, generator=g) / 4).to(device)
    w2 = (torch.randn(4, 16, 8, generator=g) / 3).to(device)
    logits = torch.randn(1, 4, generator=g).to(device)
    args = dict(hidden=hidden, w13=w13, w2=w2, router_logits=logits, top_k=2, renormalize=True)
    routed_in_up = triton_moe.routed_moe(**args, route_in_up_max_tokens=1)
    assert launched == []
    router_first = triton_moe.routed_moe(**args, route_in_up_max_tokens=0)
    assert launched == [1]
    torch.testing.assert_close(routed_in_up, router_first)


# --- device facts and tiles -----------------------------------------------------------------------

H200_INFO = DeviceInfo(H200, num_sms=132, smem_per_block=232448, capability=(9, 0))
OTHER_GPUS = [
    DeviceInfo("NVIDIA H100 80GB HBM3", num_sms=132, smem_per_block=232448, capability=(9, 0)),
    DeviceInfo("NVIDIA B200", num_sms=148, smem_per_block=232448, capability=(10, 0)),
    DeviceInfo("NVIDIA A100-SXM4-80GB", num_sms=108, smem_per_block=166912, capability=(8, 0)),
    DeviceInfo("NVIDIA L40S", num_sms=142, smem_per_block=101376, capability=(8, 9)),
]


def test_device_facts_come_from_the_device():
    info = device_info(torch.device("cpu"))
    assert info.is_interpreter
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = device_info(torch.device("cuda", 0))
        assert (cuda.name, cuda.num_sms) == (props.name, props.multi_processor_count)
        assert (cuda.capability, cuda.is_interpreter) == ((props.major, props.minor), False)


def test_tables_are_keyed_by_device_name():
    table = {H200: "measured"}
    assert tuned_for(table, H200_INFO) == "measured"
    assert tuned_for(table, DeviceInfo("NVIDIA H200 NVL", 132, 232448, (9, 0))) == "measured"
    assert all(tuned_for(table, info) is None for info in OTHER_GPUS)


@pytest.mark.parametrize("info", OTHER_GPUS, ids=lambda i: i.name)
def test_fallback_tiles_fit_the_device(info):
    """Other GPUs take heuristic tiles whose pipelines fit their shared memory (the estimates the
    pickers use; the GPU test compiles them); the H200 keeps its measured tiles."""
    from deltaserve.layers.kernels.attention import triton_attention, triton_decode
    from deltaserve.layers.kernels.moe import tiles

    for head_dim, group in ((256, 8), (128, 4)):
        cfg = triton_attention._prefill_config(head_dim, group, 2, info)
        block_d = max(16, head_dim)
        smem = triton_attention._prefill_smem(cfg["block_m"], cfg["block_n"], block_d, cfg["num_stages"], 2)
        assert smem <= info.smem_per_block and cfg["block_m"] >= group, (head_dim, cfg)
        for num_seqs in (1, 64, 256):
            cfg = triton_decode._decode_config(
                num_seqs=num_seqs, num_kv_heads=2, max_context=65536, head_dim=head_dim, group=group, elem=2, info=info
            )
            per_stage, fixed = triton_decode._decode_smem(cfg["block_n"], block_d, 16, 2)
            assert fixed + cfg["num_stages"] * per_stage <= info.smem_per_block, (num_seqs, cfg)
    for num_pairs in (128, 2048, 65536):
        cfg = tiles.sorted_config(num_pairs, 256, 2, info)
        for name, operands in (("up", 2), ("down", 1)):
            t = cfg[name]
            per_stage = 2 * t["block_k"] * (cfg["block_m"] + operands * t["block_n"])
            assert t["num_stages"] * per_stage + SMEM_SCRATCH <= info.smem_per_block, (num_pairs, name, cfg)
    h200 = triton_attention._prefill_config(256, 8, 2, H200_INFO)
    assert h200 == dict(block_m=128, block_n=64, num_warps=8, num_stages=3)
    h200 = triton_decode._decode_config(
        num_seqs=1, num_kv_heads=2, max_context=65536, head_dim=256, group=8, elem=2, info=H200_INFO
    )
    assert h200 == dict(block_n=32, num_splits=64, num_warps=4, num_stages=5)
    assert tiles.sorted_config(2048, 256, 2, H200_INFO)["up"] == dict(
        block_n=64, block_k=128, num_warps=4, num_stages=4
    )


@pytest.mark.gpu
def test_gpu_fallback_tiles_compile_within_a_small_device():
    """The tiles the pickers choose for a 99 KB device (an L40S) compile on this GPU and use no
    more shared memory than that device has: the estimates are conservative."""
    import dataclasses

    from deltaserve.layers.kernels.attention import naive as attn_naive
    from deltaserve.layers.kernels.attention import triton_attention, triton_decode

    small = dataclasses.replace(device_info(torch.device("cuda")), name="small", smem_per_block=101376)
    for kernel in (triton_decode._decode_kernel, triton_attention._prefill_kernel):
        kernel.device_caches.clear()  # only what this test compiles
    bf = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(64, 16, 2, 256, **bf)
    v_cache = torch.randn(64, 16, 2, 256, **bf)
    block_tables = torch.arange(64, dtype=torch.int32, device="cuda").view(2, 32)
    seq_lens = torch.tensor([300, 512], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 16, 256, **bf)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_tables=block_tables, scale=0.0625)
    cfg = triton_decode._decode_config(
        num_seqs=2, num_kv_heads=2, max_context=512, head_dim=256, group=8, elem=2, info=small
    )
    out = triton_decode.paged_decode_attention(**args, config=cfg)
    assert ((out.float() - attn_naive.paged_decode_attention(**args).float()).abs().max()) < 5e-2
    prefill_cfg = triton_attention._prefill_config(256, 8, 2, small)
    cu = torch.tensor([0, 300, 812], dtype=torch.int32, device="cuda")
    pq = torch.randn(812, 16, 256, **bf)
    pargs = dict(q=pq, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=block_tables)
    triton_attention.paged_attention(**pargs, scale=0.0625, config=prefill_cfg)
    for kernel in (triton_decode._decode_kernel, triton_attention._prefill_kernel):
        compiled = [k for cache in kernel.device_caches.values() for k in cache[0].values()]
        assert compiled and all(k.metadata.shared <= small.smem_per_block for k in compiled), kernel


@pytest.mark.gpu
def test_gpu_kernel_options_recapture_the_graphs(tiny_checkpoints, monkeypatch):
    """ModelRunner.set_kernel_options: the decode graphs are captured again for the new options
    (they record them) and the sampler follows. Without PDL the greedy tokens are the same bits;
    the other options pick other kernels for the same math (float32, IEEE dots): the same tokens'
    logprobs within 1e-3."""
    from deltaserve import LLM, SamplingParams

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    llm = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), device="cuda", dtype="float32", num_kv_blocks=512)
    runner = llm.engine.executor.runner
    assert runner.graphs is not None and runner.graphs.kernels == runner.kernels
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 40]

    def run():
        outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        return [o.token_ids for o in outs], [[next(iter(e.values())).logprob for e in o.logprobs] for o in outs]

    base_tokens, base_lps = run()
    base_graphs = runner.graphs
    for settings in ({"pdl": "0"}, {"row_gemv": "0"}, {"route_in_up_max_tokens": "0", "fused_gdn_max_seqs": "0"}):
        opts = KernelOptions().with_settings(settings)
        runner.set_kernel_options(opts)
        assert runner.graphs is not base_graphs and runner.graphs.kernels == opts and runner.sampler.pdl == opts.pdl
        tokens, lps = run()
        if settings == {"pdl": "0"}:
            assert tokens == base_tokens
        else:  # compared where the tokens agree so far (a near-tie may flip later ones)
            for got, want, got_lp, want_lp in zip(tokens, base_tokens, lps, base_lps, strict=True):
                same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(got))
                assert same >= 4, settings
                diffs = [abs(a - b) for a, b in zip(got_lp[:same], want_lp[:same], strict=True)]
                assert max(diffs) < 1e-3, settings
    graphs = runner.graphs
    runner.set_kernel_options(runner.kernels)  # the same options: nothing to capture
    assert runner.graphs is graphs


@pytest.mark.gpu
def test_gpu_an_h200_takes_its_measured_tables():
    """On an H200 the name torch reports finds the measured tile tables (else every kernel would
    run the heuristics); on another GPU the heuristics are what it should get."""
    from deltaserve.layers.kernels.linear.tuned import TUNED, TUNED_ROW
    from deltaserve.layers.kernels.moe.tiles import PAIRS_TILES, SORTED_TILES

    info = device_info(torch.device("cuda"))
    found = [tuned_for(table, info) is not None for table in (TUNED, TUNED_ROW, PAIRS_TILES, SORTED_TILES)]
    assert found == [("H200" in info.name)] * 4, info.name
