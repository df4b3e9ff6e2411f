"""The worker: one Ray actor per GPU (or CPU rank in tests). It joins the TP group's
torch.distributed group (NCCL on GPUs, gloo on CPU), loads only its shard, allocates its pools, and
runs the msgpack pass plans the driver broadcasts. TP rank 0 returns the sampled tokens."""

from __future__ import annotations

import os
import socket
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.cluster.shm_channel import ChannelClosed, ShmBroadcast, ShmHandle, WaitPolicy, process_alive
from deltaserve.cluster.wire import decode_plan, encode_output
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout
from deltaserve.workers.runner import ModelRunner, RunnerConfig
from deltaserve.workers.state_pool import PoolSizes


class Worker:
    """Plain class; the executor wraps it with `ray.remote` and the resources of one rank."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.runner: ModelRunner | None = None
        self._loop: threading.Thread | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for the process group's rendezvous (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(
        self, config: RunnerConfig, model_config: ModelConfig, expert_parallel: bool, master: tuple[str, int]
    ) -> PoolSizes:
        """Join the group, load this rank's shard; returns the pool sizes this rank could hold."""
        device = config.device
        if device.startswith("cuda"):
            torch.cuda.set_device(0)  # Ray exposes exactly the one GPU this actor owns
            backend = "nccl"
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            backend = "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=120),
        )
        layout = ParallelLayout(tp_rank=self.rank, tp_size=self.world_size, expert_parallel=expert_parallel)
        self.runner = ModelRunner(config, model_config, layout)
        return self.runner.sizes

    def allocate(self, sizes: PoolSizes) -> None:
        self.runner.allocate(sizes)

    def execute(self, plan_blob: bytes) -> bytes | None:
        out = self.runner.execute(decode_plan(plan_blob))
        return None if out is None else encode_output(out)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def start_channels(self, plans: ShmHandle, reply: ShmHandle, driver_pid: int, wait: WaitPolicy) -> int:
        """Serve plans from the driver's shared-memory ring on a thread of this actor until the driver
        closes it; each reply is one status byte (0 ok, 1 error) and the output (rank 0) or a traceback."""
        plan_channel = ShmBroadcast.attach(plans, reader=self.rank, wait=wait)
        reply_channel = ShmBroadcast.attach(reply, wait=wait)
        self._loop = threading.Thread(
            target=self._serve_channels, args=(plan_channel, reply_channel, driver_pid), name="plans", daemon=True
        )
        self._loop.start()
        return os.getpid()

    def _serve_channels(self, plans: ShmBroadcast, reply: ShmBroadcast, driver_pid: int) -> None:
        if self.runner is not None and self.runner.device.type == "cuda":
            torch.cuda.set_device(0)  # the current device is per thread; Ray exposes the one GPU as 0

        def alive() -> bool:
            return process_alive(driver_pid)

        try:
            while True:
                blob = plans.read(alive=alive)
                try:
                    out = self.execute(blob)
                    frame = b"\0" + (out or b"")
                except Exception:
                    frame = b"\1" + traceback.format_exc().encode()
                reply.write(frame, alive=alive)
        except ChannelClosed:
            pass  # the driver closed the ring (shutdown or restart) or is gone
        finally:
            plans.close()
            reply.close()

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
