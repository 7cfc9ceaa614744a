"""The worker: a Ray actor that holds one model replica (one pipeline stage, once pipelines
land), its optimizer, and its place in the torch.distributed group. It executes; the
coordinator decides what."""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta
from typing import Optional

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from baton.checkpoint import CheckpointStore
from baton.models import build_model, loss_sum
from baton.parallel import ParallelDims
from baton.parallel.mesh import split_micro
from baton.spec import JobSpec
from baton.training import clip_and_norm, make_optimizer, param_digest, set_lr


class Worker:
    def __init__(self, spec: JobSpec, dims: ParallelDims, rank: int):
        self.spec, self.dims, self.rank = spec, dims, rank
        self.dp_rank, self.pp_rank = dims.coords(rank)
        self.use_cuda = spec.resources.gpus_per_worker > 0
        self.device = torch.device("cuda", 0) if self.use_cuda else torch.device("cpu")
        self.bf16 = spec.train.precision == "bf16"
        torch.set_num_threads(spec.resources.threads_per_worker)
        self.ledger: Optional[list] = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the group's store."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master: tuple[str, int], table: dict, record_samples: bool) -> dict:
        """Join the process group, build the replica and its optimizer. `table` arrives as
        numpy arrays mapped from the object store (shared, read-only, no copy)."""
        spec = self.spec
        dist.init_process_group(
            "nccl" if self.use_cuda else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
            rank=self.rank, world_size=self.dims.world_size,
            timeout=timedelta(seconds=spec.parallel.timeout_s))
        self.ids, self.tokens = table["ids"], table["tokens"]
        model = build_model(spec.model, spec.train.seed).to(self.device)
        # DDP overlaps the gradient all-reduce with the backward pass (bucketed), and its
        # constructor broadcasts rank 0's parameters, so replicas start identical.
        self.model = DDP(model, device_ids=[0] if self.use_cuda else None)
        self.optimizer = make_optimizer(self.model, spec.train)
        torch.manual_seed(spec.train.seed * 100_003 + self.rank)  # dropout differs per replica
        self.ledger = [] if record_samples else None
        return {"rank": self.rank, "device": str(self.device), "backend": dist.get_backend(),
                "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    def train_step(self, step: int, batch: np.ndarray, lr: float) -> dict:
        """One optimizer step on this replica's part of the global batch `batch` (row positions).

        The loss is summed per replica and divided by the global token count, so the averaged
        gradient equals one process's gradient of the mean loss over the whole batch, even
        when the last batch of an epoch splits unevenly."""
        spec = self.spec
        mine = self.dims.replica_part(batch, self.dp_rank)
        num_micro = spec.train.global_batch // (self.dims.dp * spec.train.micro_batch)
        seq_len = spec.model.seq_len
        # DDP divides the summed gradients by dp; multiplying by dp leaves the plain sum.
        scale = self.dims.dp / (len(batch) * seq_len)
        total = torch.zeros((), device=self.device)
        micro = split_micro(mine, num_micro)
        for i, rows in enumerate(micro):
            sync = i == len(micro) - 1
            weight = 1.0 if len(rows) else 0.0
            if not len(rows):  # every replica must join every all-reduce: run a zero-weight pass
                rows = mine[:1] if len(mine) else batch[:1]
            data = torch.from_numpy(self.tokens[rows]).to(self.device, torch.long)
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
                    logits = self.model(data[:, :-1])
                ls = loss_sum(logits, data[:, 1:]) * weight
                (ls * scale).backward()
            total += ls.detach()
            if weight and self.ledger is not None:
                self.ledger.append((step, self.ids[rows].tolist()))
        set_lr(self.optimizer, lr)
        grad_norm = clip_and_norm(self.model, spec.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss_sum": float(total), "tokens": len(mine) * seq_len, "grad_norm": grad_norm}

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, root: str, step: int) -> None:
        store = CheckpointStore(root)
        if self.dp_rank == 0:  # replicas are identical: one copy of each stage is enough
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            store.write_tensors(step, "model.pt", model_state)
            store.write_tensors(step, "optim.pt", optim_state)
        rng = {"cpu": torch.get_rng_state()}
        if self.use_cuda:
            rng["cuda"] = torch.cuda.get_rng_state()
        store.write_tensors(step, f"rng-rank{self.rank:04d}.pt", rng)

    def load(self, root: str, step: int, restore_rng: bool) -> None:
        store = CheckpointStore(root)
        set_state_dict(self.model, self.optimizer,
                       model_state_dict=store.read_tensors(step, "model.pt"),
                       optim_state_dict=store.read_tensors(step, "optim.pt"))
        if restore_rng:  # same layout: continue each worker's random stream exactly
            rng = store.read_tensors(step, f"rng-rank{self.rank:04d}.pt")
            torch.set_rng_state(rng["cpu"])
            if self.use_cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"])

    # -- inspection ---------------------------------------------------------------------------

    def digest(self) -> str:
        return param_digest(self.model.module)

    def take_ledger(self) -> list:
        """The (step, sample ids) trained on since the last call; empties the ledger."""
        out = self.ledger or []
        if self.ledger is not None:
            self.ledger = []
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
