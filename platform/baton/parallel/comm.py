"""Gradient communication (`parallel.grad_comm`): what the replicas send each other.

- fp32: gradients reduced as computed (the default; the equivalence contract's setting).
- bf16: gradients cast to bfloat16 for the reduction and back: half the bytes, each gradient
  within bf16's rounding (8 bits of mantissa) of the fp32 sum. Through a DDP communication
  hook of baton's own (DDP's `bf16_compress_hook` refuses anything but NCCL), FSDP2's reduce
  dtype, and the pipeline's own all-reduce.
- powersgd: DDP's PowerSGD hook (Vogels et al., 2019): each gradient matrix sent as a rank-2
  factorisation with error feedback, after 10 steps of plain all-reduce (PowerSGD's advice:
  compress once the gradients settle). DDP only (shard: none or optimizer, pp 1). Its error
  feedback lives in the workers and is not checkpointed: a recovered or resumed run starts it
  afresh, so such a run is not bitwise the uninterrupted one; a skipped step (its gradient
  not finite: train.skip_nonfinite) drops it too (`forget`).

Pays off where the links are slow next to the compute (many nodes, Ethernet between them);
on one node's NVLink or shared memory, the cast costs about what it saves."""

from __future__ import annotations

import torch
import torch.distributed as dist

POWERSGD_RANK = 2
POWERSGD_START = 10  # steps of plain all-reduce first
POWERSGD_EPSILON = 1e-8  # torch's suggestion (powerSGD_hook._orthogonalize_gram_schmidt)


def bf16_hook(process_group, bucket):
    """A DDP communication hook: the bucket reduced in bfloat16 (averaged, as DDP does)."""
    group = process_group or dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def back(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out

    return future.then(back)


def register(ddp, grad_comm: str):
    """Set DDP's communication for `grad_comm`, over DDP's own group (under tensor
    parallelism, the workers holding one share; the world is every share's). Returns what
    the hook carries from step to step (PowerSGD's state), or None."""
    if grad_comm == "bf16":
        ddp.register_comm_hook(ddp.process_group, bf16_hook)
    elif grad_comm == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # The epsilon keeps a gradient that is all zeros (a tp worker's share of the token
        # embedding when no token of a batch falls in its rows; a layer a zero gate holds
        # off) from dividing by its zero norm: without it the factors, then the parameters,
        # turned NaN at the first compressed step (dp 2 x tp 2 on byte-level text: tokens
        # below 128 only, and the second worker's rows are 128-255). torch's default is 0.
        state = psgd.PowerSGDState(process_group=ddp.process_group,
                                   matrix_approximation_rank=POWERSGD_RANK,
                                   start_powerSGD_iter=POWERSGD_START,
                                   orthogonalization_epsilon=POWERSGD_EPSILON)
        hook = psgd.powerSGD_hook
        ddp.register_comm_hook(state, _in_order(hook) if dist.get_backend() == "gloo" else hook)
        return state
    return None


def forget(state) -> None:
    """Drop what PowerSGD carries between steps (its error feedback, and the factors it
    starts the next step's from), after a step whose gradient was not finite
    (train.skip_nonfinite): they hold its NaNs, which every later step would add to its
    gradient. The next compressed step starts them afresh, as after a recovery."""
    if state is not None:
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()


def _in_order(hook):
    """`hook`, each bucket's chain of collectives finished before the next bucket's starts.
    PowerSGD's hook all-reduces a bucket's P factors, then (in a callback on whichever thread
    completed them) its Q factors: with several buckets in flight, two ranks can issue one
    bucket's Q and another's P in different orders, and gloo, which pairs collectives by
    order, aborts the process ("Received data size doesn't match"; reproduced at every try
    with 2 ranks and small buckets, and in a quick-start run at step 15). NCCL, PowerSGD's
    home, orders them on its stream. Waiting here gives up overlapping this bucket's
    communication with the rest of the backward, on gloo only."""

    def ordered(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future
    return ordered


def reduce_dtype(grad_comm: str) -> torch.dtype:
    """FSDP2's reduce-scatter dtype."""
    return torch.bfloat16 if grad_comm == "bf16" else torch.float32


def all_reduce(flat: torch.Tensor, group, grad_comm: str) -> None:
    """Sum `flat` over `group` in place (a pipeline stage's replicas), in bf16 if asked."""
    if grad_comm != "bf16":
        dist.all_reduce(flat, group=group)
        return
    low = flat.to(torch.bfloat16)
    dist.all_reduce(low, group=group)
    flat.copy_(low)


class FlatGrads:
    """A pipeline stage's gradients as views into one flat buffer, summed over the stage's
    replicas in place there, as DDP's are in its buckets (`gradient_as_bucket_view`). The
    first step copies its gradients in and leaves each parameter's `.grad` a view; after
    that, autograd accumulates into the views, and `zero` clears them with one fill instead
    of freeing them. Before, each step flattened the gradients into a new tensor and copied
    the sums back: a second copy of them at the all-reduce (benchmarks/pipeline_grads.py)."""

    def __init__(self, group, grad_comm: str):
        self.group, self.grad_comm = group, grad_comm
        self.flat: torch.Tensor | None = None
        self.count = 0

    def all_reduce(self, params: list) -> None:
        grads = [q.grad for q in params]
        if not grads:  # a stage that trains nothing (model.lora), on all its replicas alike
            return
        if len(grads) != self.count or any(g._base is not self.flat for g in grads):
            self.flat = torch._utils._flatten_dense_tensors(grads)
            for q, view in zip(params, torch._utils._unflatten_dense_tensors(self.flat, grads)):
                q.grad = view
            self.count = len(grads)
        all_reduce(self.flat, self.group, self.grad_comm)

    def zero(self) -> bool:
        """Zero the gradients, keeping them views; False before the first all-reduce."""
        if self.flat is None:
            return False
        self.flat.zero_()
        return True


def fsdp_reduce_scatter():
    """FSDP2's reduce-scatter on gloo, as an all-reduce of the whole buffer of which each rank
    keeps its own slice. Gloo's reduce-scatter was the slower of the two on a 2-core machine:
    16.2 against 12.3 ms (slice copy included) for a 12.7 MiB buffer over 2 ranks, 31.1
    against 24.8 ms over 4 (`python benchmarks/fsdp_comm.py`, which also shows that on a
    ZeRO-3 step the difference is within the noise). NCCL keeps its own reduce-scatter
    (FSDP's default), which moves half an all-reduce's bytes."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class AllReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)
            n = output_tensor.numel()
            output_tensor.copy_(input_tensor[group.rank() * n:(group.rank() + 1) * n])
            return None
    return AllReduceScatter()
