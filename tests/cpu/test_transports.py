"""Weight-sync transports deliver every tensor bit for bit.

Proves: the gloo ``BroadcastGroup`` (the CPU twin of the NCCL path) carries a
bucket of mixed dtypes and shapes from group rank 0 to two receivers exactly,
in order, bucket after bucket, while the processes also hold a default process
group of their own (as training ranks do); ``buckets_from_disk`` returns exactly
what ``save_hf_folder`` wrote. The object-store path is covered end to end in
``test_trainer.py``.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from vime.weights.hf_export import save_hf_folder
from vime.weights.transports import BroadcastGroup, buckets_from_disk, free_port, metadata_of


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [
            ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
            ("model.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("step", torch.tensor([3, 1, 4], dtype=torch.int64)),
        ],
        [("lm_head.weight", torch.randn(3, 2, 2, generator=g).to(torch.float16))],
    ]


def _member(rank: int, port: int, default_port: int, queue: mp.Queue) -> None:
    import torch.distributed as dist

    # A default group of its own first: the broadcast group must not need or disturb it.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1
    )
    group = BroadcastGroup("127.0.0.1", port, rank, 3, backend="gloo", timeout_s=60)
    for bucket in _buckets():
        if rank == 0:
            group.send(bucket)
        else:
            got = group.receive(metadata_of(bucket))
            same = [
                n1 == n2 and torch.equal(a, b) and a.dtype == b.dtype
                for (n1, a), (n2, b) in zip(got, bucket, strict=True)
            ]
            queue.put((rank, all(same), [n for n, _ in got]))
    dist.destroy_process_group()


def test_gloo_broadcast_group_delivers_buckets_exactly() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_member, args=(rank, port, free_port(), queue)) for rank in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = [queue.get(timeout=5) for _ in range(4)]
    assert sorted(r for r, _, _ in results) == [1, 1, 2, 2]
    assert all(ok for _, ok, _ in results)
    names = {tuple(n) for _, _, n in results}
    assert names == {
        ("model.embed_tokens.weight", "model.norm.weight", "step"),
        ("lm_head.weight",),
    }


def test_disk_buckets_round_trip(tmp_path) -> None:
    buckets = _buckets()
    from transformers import Qwen3Config

    save_hf_folder(str(tmp_path / "hf"), iter(buckets), config=Qwen3Config(), max_shard_bytes=200)
    loaded = dict(t for bucket in buckets_from_disk(str(tmp_path / "hf")) for t in bucket)
    expected = dict(t for bucket in buckets for t in bucket)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype, name
