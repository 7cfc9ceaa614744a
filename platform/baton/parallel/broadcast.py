"""A worker's state sent from one rank to every rank of the process group: a world that grows
gives its new workers a running replica's parameters and optimizer state this way, instead of
a checkpoint written and read back."""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads


BUCKET_BYTES = 32 * 2**20  # tensors of one dtype sent together, up to this much (or one larger)


def broadcast_state(state: Any, src: int, device: torch.device) -> Any:
    """`state` (nested dicts, lists and tuples of tensors and plain values) as rank `src` holds
    it, on every rank: its structure and plain values in one message, then its tensors in
    buckets of one dtype through `device` (the group's: NCCL sends only device memory), each
    back on the device type it had at `src` (AdamW keeps its step counts on the host). No rank
    holds more than a bucket beyond the state."""
    message: list = [None]
    rank = dist.get_rank()
    if rank == src:
        leaves, spec = tree_flatten(state)
        message = [(treespec_dumps(spec),
                    [(tuple(x.shape), x.dtype, x.device.type) if torch.is_tensor(x) else None
                     for x in leaves],
                    [None if torch.is_tensor(x) else x for x in leaves])]
    dist.broadcast_object_list(message, src=src, device=device)
    spec, about, out = message[0]
    for bucket in _buckets(about):
        sizes = [math.prod(about[i][0]) for i in bucket]
        if rank != src:
            flat = torch.empty(sum(sizes), dtype=about[bucket[0]][1], device=device)
        elif len(bucket) == 1:
            flat = leaves[bucket[0]].reshape(-1).to(device)
        else:
            flat = torch.cat([leaves[i].reshape(-1).to(device) for i in bucket])
        dist.broadcast(flat, src=src)
        for i, part in zip(bucket, flat.split(sizes)):
            shape, _, kind = about[i]
            out[i] = part.view(shape).to(kind)
    return tree_unflatten(out, treespec_loads(spec))


def _buckets(about: list) -> Iterator[list[int]]:
    """The tensors' indices in buckets of one dtype, in an order every rank computes alike."""
    filling: dict = {}  # dtype -> (indices, bytes)
    for i, tensor in enumerate(about):
        if tensor is None:
            continue
        shape, dtype, _ = tensor
        nbytes = math.prod(shape) * dtype.itemsize
        indices, size = filling.get(dtype, ([], 0))
        if indices and size + nbytes > BUCKET_BYTES:
            yield indices
            indices, size = [], 0
        filling[dtype] = (indices + [i], size + nbytes)
    yield from (indices for indices, _ in filling.values() if indices)
