"""The training ranks as Ray actors: ``RayTrainGroup`` fans each call out to every rank.

Where it fits: ``vime.trainer`` owns one group. Every rank is a ``TrainWorker``
holding the backend's ``TrainActor`` (``policy_actor.make_actor`` for
``--train-backend``), initialised from the run's ``TrainSettings``
(``vime.config.train_settings``); the worker sets the torch.distributed environment
before the backend initializes, and runs the sending side of the run's weight transport
(``vime.ray.transports``: rank 0 sends; the other ranks take part in the
all-gathers of ``sync_buckets``). The loop only calls the group's methods, each
of which returns rank 0's answer once every rank has finished, or raises as soon
as any rank fails.

Timing (``vime.profiling``): each rank records a span around every call that works
(train, each log-prob pass, the weight send, sleep/wake, save, export), drained by
the driver once per rollout; it measures its peak FLOP/s once at start-up, when the
driver first asks (``vime.perf.rank_peak``), and runs torch.profiler for
``--profile-rollouts``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import ray

from vime import device as vime_device
from vime import perf, profiling
from vime.ray import folders
from vime.ray.errors import label_actor, wait_all
from vime.ray.placement import Placement, pin_process, process_cores
from vime.ray.transports import transport_class

if TYPE_CHECKING:
    from vime.backends.base import TrainSettings


class TrainWorker:
    """One training rank (wrapped by ``ray.remote`` below)."""

    def __init__(self, backend: str, rank: int, world: int) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.actor = None
        self.weight_link: Any = None  # what the run's transport keeps here (open_weight_link)
        self._profile = profiling.TorchProfile()
        self._peak: perf.Peak | None = None

    def address(self) -> tuple[str, int]:
        from vime.weights.transports import free_port, node_ip

        return node_ip(), free_port()

    def init(
        self,
        settings: TrainSettings,
        master: tuple[str, int],
        num_threads: int,
        cores: Sequence[int] | None = None,
    ) -> tuple[int, float]:
        """Build the backend; returns the rollout the run starts at and when this rank was
        done (``time.time()``). ``cores``: this rank's own CPU cores (its threads follow)."""
        import torch

        if cores:
            pin_process(cores)
            num_threads = len(cores)
        torch.set_num_threads(num_threads)
        os.environ.update(
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK=str(self.rank % max(1, settings.gpus_per_node)),
        )
        if vime_device.cuda_available():
            # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
            os.environ["LOCAL_RANK"] = "0"
        from vime.backends.policy_actor import make_actor  # torch: in the rank only

        self.actor = make_actor(self.backend)
        start = self.actor.init(settings)
        # The backend's train() runs its old/ref log-prob passes through this method: timed
        # on the instance, each pass that actually runs is a span (the FLOP count reads
        # them), with no hook in the backend.
        passes = self.actor.compute_log_probs

        def log_probs(schedule: Any, which: str, **options: Any) -> Any:
            with profiling.span("log_probs", which=which):
                return passes(schedule, which, **options)

        self.actor.compute_log_probs = log_probs
        profiling.enable()
        return start, time.time()

    def cpu_cores(self) -> list[int]:
        """The CPU cores this rank's process may run on, over all its threads."""
        return process_cores()

    def see_folders(self, markers: folders.Markers) -> tuple[str, str, list[str]]:
        """This rank's node (id, IP) and the flags whose driver's marker it cannot read."""
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), folders.unseen(markers)

    def peak(self) -> perf.Peak:
        """This rank's peak FLOP/s, measured at the first call: the driver asks every rank
        at once, as they will train, once the engines have started (the engines load
        while the ranks initialise, and a matmul timed beside them would read low)."""
        if self._peak is None:
            self._peak = perf.rank_peak(vime_device.local_device())
        return self._peak

    def drain_spans(self) -> list[profiling.Span]:
        return profiling.drain()

    def start_profile(self) -> None:
        self._profile.start()

    def stop_profile(self) -> list[dict[str, Any]]:
        return self._profile.stop()

    @profiling.timed("train")
    def train(self, schedule: Any) -> dict[str, float]:
        return self.actor.train(schedule)

    def compute_log_probs(self, schedule: Any, which: str) -> Any:
        return self.actor.compute_log_probs(schedule, which)

    @profiling.timed("save")
    def save(self, rollout_id: int, extra: dict[str, Any]) -> None:
        self.actor.save(rollout_id, extra)

    def loaded_extra(self) -> dict[str, Any]:
        return getattr(self.actor, "loaded_extra", {}) or {}

    @profiling.timed("export_hf")
    def export_hf(self, path: str, merged: bool = False) -> None:
        self.actor.export_hf(path, merged)

    @profiling.timed("sleep")
    def sleep(self, tags: Sequence[str] | None = None) -> None:
        self.actor.sleep(tags)

    @profiling.timed("wake_up")
    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.actor.wake_up(tags)

    # --- weight transports: each one's sending side (vime.ray.transports) runs here ---

    def sync_buckets(self, bucket_bytes: int) -> Iterable[Any]:
        """What a sync sends, bucket by bucket (``TrainActor.sync_buckets``): a collective
        every rank iterates."""
        return self.actor.sync_buckets(bucket_bytes)

    def open_weight_link(self, transport: str, *args: Any) -> None:
        """Keep what ``transport`` sends through (the broadcast group)."""
        self.weight_link = transport_class(transport).open_sender(*args)

    @profiling.timed("send_weights")
    def send_weights(self, transport: str, settings: Any, engines: list[Any], version: int) -> Any:
        """``transport``'s send, on every rank at once (rank 0 sends)."""
        return transport_class(transport).send(self, settings, engines, version)


class RayTrainGroup:
    """All training ranks of the run; methods return rank 0's result."""

    def __init__(self, backend: str, placement: Placement) -> None:
        layout = placement.layout
        remote = ray.remote(TrainWorker)
        self.world = layout.num_train
        self.workers = [
            label_actor(
                remote.options(
                    num_cpus=1,
                    num_gpus=(0.8 if layout.colocate else 1) if layout.use_gpu else 0,
                    scheduling_strategy=placement.strategy(rank),
                ).remote(backend, rank, self.world),
                f"training rank {rank}",
            )
            for rank in range(self.world)
        ]
        self._init_refs: list[Any] = []
        self._folder_check: tuple[Any, ...] = ({}, {}, [])
        self.rank_nodes: list[str] = []  # each rank's Ray node id, once initialised
        self.init_done_at: float | None = None

    def submit(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank; returns the refs at once, in rank order."""
        return [getattr(w, method).remote(*args) for w in self.workers]

    def _all(self, what: str, method: str, *args: Any) -> list[Any]:
        return wait_all(self.submit(method, *args), what)

    def check_folders(self, rank_folders: Sequence[tuple[str, str]]) -> list[str]:
        """Refuse (``ConfigError``, one line) a ``(flag, folder)`` some rank does not see as
        the driver does (``vime.ray.folders``); returns each rank's node id, in rank order."""
        return self._folders_seen(*self._show_folders(rank_folders))

    def _show_folders(self, rank_folders: Sequence[tuple[str, str]]) -> tuple[Any, ...]:
        """Write the markers and ask every rank to read them (answers not waited for)."""
        markers = folders.write_markers(rank_folders)
        return markers, dict(rank_folders), self.submit("see_folders", markers)

    def _folders_seen(self, markers: folders.Markers, where: dict[str, str], refs: list) -> list:
        try:
            seen = wait_all(refs, "checking the ranks' folders")
        finally:
            folders.remove_markers(markers)
        for rank, (node_id, ip, missing) in enumerate(seen):
            if missing:
                node = f"{ip} (Ray node {node_id[:12]})"
                raise folders.refusal(missing[0], where[missing[0]], rank, node)
        return [node_id for node_id, _, _ in seen]

    def start_init(
        self,
        settings: TrainSettings,
        num_threads: int,
        cpu_cores: Sequence[Sequence[int]] | None = None,
        rank_folders: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Start every rank's initialisation and return at once: the driver starts the
        engines meanwhile. Rank 0's address (the process group's master) goes to the
        ranks as a ref, which Ray resolves before their ``init`` runs. ``cpu_cores``: each
        rank's own cores, or None to leave placement to the OS. ``rank_folders``: checked
        as ``check_folders`` does, before each rank's ``init`` (a rank runs its calls in
        order); ``finish_init`` refuses a folder a rank does not see."""
        self._folder_check = self._show_folders(rank_folders)
        master = self.workers[0].address.remote()
        self._init_refs = [
            w.init.remote(
                settings, master, num_threads, None if cpu_cores is None else cpu_cores[r]
            )
            for r, w in enumerate(self.workers)
        ]

    def finish_init(self) -> int:
        """Wait for ``start_init``'s ranks; returns the rollout the run starts at. Sets
        ``init_done_at``: when the last rank was done, by its own clock (the driver may
        have been waiting on the engines then)."""
        self.rank_nodes = self._folders_seen(*self._folder_check)
        done = wait_all(self._init_refs, "initializing the training ranks")
        self.init_done_at = max(at for _, at in done)
        return done[0][0]

    def train(self, schedule_ref: Any) -> dict[str, float]:
        return self._all("training", "train", schedule_ref)[0]

    def save(self, rollout_id: int, extra: dict[str, Any]) -> None:
        self._all(f"saving rollout {rollout_id}", "save", rollout_id, extra)

    def cpu_cores(self) -> list[list[int]]:
        """Every rank's CPU cores, as its process sees them."""
        return self._all("reading the ranks' CPU cores", "cpu_cores")

    def peaks(self) -> list[perf.Peak]:
        """Every rank's peak FLOP/s (``vime.perf.rank_peak``, found at start-up)."""
        return self._all("reading the ranks' peak FLOP/s", "peak")

    def drain_spans(self) -> list[list[profiling.Span]]:
        """Every rank's spans since the last drain, in rank order."""
        return self._all("reading the ranks' timings", "drain_spans")

    def start_profile(self) -> None:
        self._all("starting the profiler", "start_profile")

    def stop_profile(self) -> list[list[dict[str, Any]]]:
        """Every rank's torch.profiler events since ``start_profile``."""
        return self._all("stopping the profiler", "stop_profile")

    def loaded_extra(self) -> dict[str, Any]:
        (extra,) = wait_all([self.workers[0].loaded_extra.remote()], "reading the checkpoint")
        return extra

    def export_hf(self, path: str, merged: bool = False) -> None:
        self._all(f"exporting to {path}", "export_hf", path, merged)

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """Every rank frees the ``TRAIN_MEMORY_TAGS`` parts named (all for None)."""
        self._all("putting training to sleep", "sleep", tags)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._all("waking training", "wake_up", tags)
