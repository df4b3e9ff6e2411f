"""The offline benchmark's expert counter (its memory floor counts the experts a step's routing
selected): it must see every MoE block of a pass, whatever form the decoder layer calls it in."""

from __future__ import annotations

from passes import Sequences

from deltaserve.bench.offline import ExpertCounter
from deltaserve.layers.loader import load_model
from deltaserve.layers.moe import SparseMoeBlock


def test_expert_counter_sees_every_moe_block(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    model = load_model(path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    counter = ExpertCounter(model)
    counter.enabled = True
    seqs = Sequences(model)
    seqs.add("a")
    seqs.add("b")
    seqs.run([("a", [5, 9, 11, 4]), ("b", [7, 3])])  # six tokens
    assert len(counter.distinct) == len(blocks)  # one count per block and pass
    for block, distinct in zip(blocks, counter.distinct, strict=True):
        assert 1 <= distinct <= min(block.num_experts, 6 * block.top_k)
    counter.enabled = False
    seqs.run([("a", [1])])
    assert len(counter.distinct) == len(blocks)  # disabled: nothing counted
