"""CheckedGraphs: a prefill-graph pass and the eager pass of the same plan from the same pools, compared
(tests/test_prefill_graphs.py on the CPU, tests/test_gpu_prefill_graphs.py on CUDA)."""

from __future__ import annotations

import torch

from deltaserve.workers.context import build_forward_context


class CheckedGraphs:
    """A runner's PrefillGraphs (captured, or the static forward) with each pass also run eagerly from
    the same pools: records the largest logit difference (over the logits' largest magnitude, at
    least 1) and pool difference (scratch page and slot left out)."""

    def __init__(self, runner, graphs):
        self.runner, self.graphs = runner, graphs
        self.passes, self.with_captures = 0, 0
        self.logit_diff = self.pool_diff = 0.0

    def can_run(self, plan) -> bool:
        return self.graphs.can_run(plan)

    def _pools(self) -> list[torch.Tensor]:
        p = self.runner.pool
        return [t for t in (p.k_pages, p.v_pages, p.recurrent, p.conv) if t is not None]

    def _compared(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = self.runner.sizes
        out = []
        for t, kind in zip(tensors, ("page", "page", "slot", "slot"), strict=False):
            keep = torch.ones(t.shape[1], dtype=torch.bool)
            keep[sizes.num_blocks - 1 if kind == "page" else sizes.num_slots - 1] = False
            out.append(t[:, keep.to(t.device)])
        return out

    def run(self, plan, indices):
        before = [t.clone() for t in self._pools()]
        got = self.graphs.run(plan, indices)
        after_graph = [t.clone() for t in self._pools()]
        for t, b in zip(self._pools(), before, strict=True):
            t.copy_(b)
        runner = self.runner
        ctx = build_forward_context(plan, runner.model_config, runner.layout, runner.device, indices,
                                    kernels=runner.kernels)  # fmt: skip
        with torch.inference_mode():
            hidden = runner.model(ctx, runner.pool.layer_states)
            want = runner.model.compute_logits(hidden[ctx.logits_indices]) if len(indices) else None
        self.passes += 1
        self.with_captures += plan.captures is not None and len(plan.captures) > 0
        if want is not None:  # relative to the logits' scale: float32 sums over padded and unpadded rows
            scale = max(1.0, float(want.abs().max()))
            self.logit_diff = max(self.logit_diff, float((got - want).abs().max()) / scale)
        for a, b in zip(self._compared(after_graph), self._compared(self._pools()), strict=True):
            self.pool_diff = max(self.pool_diff, float((a.double() - b.double()).abs().max()))
        return got
