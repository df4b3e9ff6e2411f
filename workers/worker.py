"""The worker: one Ray actor per GPU (or CPU rank in tests). It joins the TP group's
torch.distributed group (NCCL on GPUs, gloo on CPU), loads only its shard, allocates its pools, and
runs the msgpack pass plans the driver broadcasts. TP rank 0 returns the sampled tokens."""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout
from deltaserve.workers.config import WorkerConfig
from deltaserve.workers.plan import PoolSizes, RunnerOutput
from deltaserve.workers.runner import ModelRunner
from deltaserve.workers.shm_ring import ChannelClosed, ShmBroadcast, ShmHandle, WaitPolicy, process_alive
from deltaserve.workers.wire import decode_plan, encode_error_reply, encode_output, encode_reply, rerun_codec


class Worker:
    """Plain class; the executor wraps it with `ray.remote` and the resources of one rank."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.runner: ModelRunner | None = None
        self._loop: threading.Thread | None = None
        self._last_plan: bytes | None = None  # the last plan blob and output, re-coded by _warm
        self._last_output: RunnerOutput | None = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for the process group's rendezvous (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, config: WorkerConfig, model_config: ModelConfig, master: tuple[str, int]) -> PoolSizes:
        """Join the group, load this rank's shard; returns the pool sizes this rank could hold."""
        device = config.load.device
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
        layout = ParallelLayout(self.rank, self.world_size, expert_parallel=config.parallel.enable_expert_parallel)
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
        closes it; each reply is one status byte (0 ok, 1 error) and the output (rank 0) or a traceback.
        Replies go back in pass order, one per plan."""
        plan_channel = ShmBroadcast.attach(plans, reader=self.rank, wait=wait)
        reply_channel = ShmBroadcast.attach(reply, wait=wait)
        self._loop = threading.Thread(
            target=self._serve_channels, args=(plan_channel, reply_channel, driver_pid), name="plans", daemon=True
        )
        self._loop.start()
        return os.getpid()

    def _serve_channels(self, plans: ShmBroadcast, reply: ShmBroadcast, driver_pid: int) -> None:
        """At most one pass in flight: after launching pass k the loop waits (the channel's WaitPolicy)
        for whichever comes first, plan k+1 or the end of pass k. A new plan is launched at once
        (stream order keeps the passes in order; the runner reads its `input_from_prev` ids from pass
        k's device tensor), then pass k's reply is written. With no new plan, pass k's reply is written
        as soon as it is done, so a synchronous driver (reply k before plan k+1) never deadlocks."""
        if self.runner is not None and self.runner.device.type == "cuda":
            torch.cuda.set_device(0)  # the current device is per thread; Ray exposes the one GPU as 0

        def alive() -> bool:
            return process_alive(driver_pid)

        in_flight: _Launched | None = None  # launched, its reply not written yet
        try:
            while True:
                if in_flight is None:
                    in_flight = self._launch(plans.read(alive=alive))
                    continue
                plans.wait_pending_or(in_flight.done, alive=alive, idle=self._warm)
                following = self._launch(plans.try_read()) if plans.pending() else None
                reply.write(in_flight.frame(), alive=alive)
                self._last_output = in_flight.output or self._last_output
                in_flight = following
        except ChannelClosed:
            pass  # the driver closed the ring (shutdown or restart) or is gone
        finally:
            plans.close()
            reply.close()

    def _warm(self) -> None:
        """While a pass runs on the device: decode the last plan and encode the last output again
        (results dropped). Launching a pass evicts the codec's code and data from the CPU caches;
        cold, the next plan's decode took ~5x its warm time, on the control path of every pass."""
        if not rerun_codec(plan_blob=self._last_plan, output=self._last_output):
            self._last_plan = self._last_output = None

    def _launch(self, blob: bytes) -> _Launched:
        read = time.perf_counter()
        try:
            plan = decode_plan(blob)
            decoded = time.perf_counter()
            self._last_plan = blob  # a plan that decodes (the warm-up re-decodes it)
            return _Launched(self.runner.execute_async(plan), stamps=(read, decoded, time.perf_counter()))
        except Exception:
            return _Launched(None, traceback.format_exc())

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Launched:
    """A pass launched by the channel loop (or its launch error); `frame()` waits for its reply.
    `stamps`: when the plan was read, decoded and launched (the reply adds three more)."""

    def __init__(self, handle, error: str | None = None, stamps: tuple[float, ...] = ()):
        self.handle, self.error, self.stamps = handle, error, stamps
        self.output: RunnerOutput | None = None  # rank 0's, once frame() ran

    def done(self) -> bool:
        return self.error is not None or self.handle.done()

    def frame(self) -> bytes:
        if self.error is None:
            try:
                started = time.perf_counter()
                out = self.output = self.handle.result()
                resolved = time.perf_counter()
                blob = b"" if out is None else encode_output(out)
                return encode_reply(blob, (*self.stamps, started, resolved, time.perf_counter()))
            except Exception:
                self.error = traceback.format_exc()
        return encode_error_reply(self.error)
