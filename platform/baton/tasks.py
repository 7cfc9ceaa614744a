"""Tasks: what a batch is for. A task turns the model's output on a batch into a loss and named
metrics; the engines (DDP, sharded, pipelines) only run the model and call the task.

A batch is a dict of tensors, one per entry of `data.columns` (first dimension: samples), and
`VALID`, a bool tensor that is False on padding rows (an engine pads a replica's empty
micro-batch, and a pipeline's short ones, so that every collective and every message keeps its
shape). The model's input is `batch["inputs"]` (`batch["tokens"][:, :-1]` for a language model).

A task's loss and metrics are *sums* over the valid rows' terms (tokens for a language model,
samples otherwise): baton divides them by the global count of terms, so a batch split unevenly
across replicas averages exactly as one process would.

A user's task is `package.module:function`, called as `function(output, batch)` and returning a
dict of scalar tensors: "loss" (summed over the valid rows, differentiable) and any metric sums
(accuracy: the number of correct rows). Its model's input is `batch["inputs"]`. A metric that
is not a mean over rows (precision, recall, F1) is a pair of sums, (numerator, denominator):
both are summed over the step (or the evaluation) and every replica, then divided, as
`torchmetrics` computes them from summed counts. A metric of the whole set's scores (the area
under the ROC curve, average precision) is `auroc(...)` or `average_precision(...)`, or over
classes, one against the rest, `macro_auroc(...)` or `macro_average_precision(...)`: counts
of positives and negatives by score bin, summed the same way and read off at the end, as
`torchmetrics`' binned forms (`thresholds=N`) compute them.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Callable, Optional

from baton.errors import reason

# torch is imported where used: the spec's checks read task names before torch loads. An
# import of a module already loaded costs 0.1-0.2 us (timeit), a few a micro-batch.
if TYPE_CHECKING:
    import torch

VALID = "valid"
LOSS_MASK = "loss_mask"  # a language model's targets (data.loss_mask_column), when it has them
IGNORE = -100  # target of a padding position: no loss, no gradient


class Task:
    name = ""
    needs: tuple[str, ...] = ("inputs",)  # data.columns keys the task reads
    per_sample = 1  # loss terms a sample contributes
    # its loss terms are counted from the data (a language model's loss mask: `targets`),
    # not per_sample a row: the loss is their mean over the whole batch
    masked = False
    # what its evaluation reports besides the loss; None: known only when it runs (a task of
    # your own), which checkpoint.best's check cannot look into
    metrics: Optional[tuple[str, ...]] = None
    eod: Optional[int] = None  # the end-of-document token of data.document_mask's rows

    def inputs(self, batch: dict) -> torch.Tensor:
        return batch["inputs"]

    def documents(self, batch: dict, device=None):
        """Where the documents packed into the rows of the batch's inputs (token ids) end,
        for a model whose attention keeps each to itself (models/documents.py); None: the
        inputs attend as one sequence (no `eod`: not data.document_mask's)."""
        if self.eod is None:
            return None
        from baton.models.documents import documents

        return documents(self.inputs(batch), self.eod, device)

    def loss(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
        """(loss sum, {metric: sum}) over the batch's valid rows."""
        raise NotImplementedError


class LanguageModel(Task):
    """Next-token prediction over rows of seq_len + 1 token ids; `masked`: only the tokens
    the row's loss mask marks are targets (a response's, not its prompt's)."""

    name, needs = "language_model", ("tokens",)
    metrics = ()
    split_logits = True  # its loss takes logits split by vocabulary (tensor parallelism)

    def __init__(self, seq_len: int, masked: bool = False, eod: Optional[int] = None):
        self.per_sample, self.masked, self.eod = seq_len, masked, eod
        if masked:
            self.needs = ("tokens", LOSS_MASK)

    def inputs(self, batch: dict) -> torch.Tensor:
        return batch["tokens"][:, :-1]

    def _kept(self, batch: dict) -> torch.Tensor:
        kept = batch[VALID][:, None]
        return kept & batch[LOSS_MASK][:, 1:].bool() if self.masked else kept

    def loss(self, output, batch):
        return loss_sum(output, self.labels(batch)), {}

    def labels(self, batch: dict) -> torch.Tensor:
        """Each position's target (B, seq_len): the next token, IGNORE where it is none."""
        return batch["tokens"][:, 1:].masked_fill(~self._kept(batch), IGNORE)

    def count(self, batch: dict) -> torch.Tensor:
        """The batch's targets (the loss's terms)."""
        return self.kept(batch).sum()

    def kept(self, batch: dict) -> torch.Tensor:
        """Where the batch's targets are (B, seq_len) bool."""
        return self._kept(batch).expand(-1, self.per_sample)

    @staticmethod
    def targets(columns: dict) -> int:
        """The targets of rows as read (numpy columns), before they are a batch: what the
        worker counts to scale a step's loss by the whole batch's targets."""
        return int(columns[LOSS_MASK][:, 1:].sum())


class SequencePart(Task):
    """A language model as a context-parallel worker computes it (parallel/context.py): the
    model's inputs and the loss's targets are its part of each row's positions, and its sums
    count that part's terms, so that the sums of a replica's cp workers add up to the
    replica's. Where the documents are is read from the whole rows."""

    split_logits = LanguageModel.split_logits  # (under tensor parallelism too)

    def __init__(self, task: LanguageModel, split):
        self.task, self.split = task, split
        self.name, self.needs, self.metrics = task.name, task.needs, task.metrics
        self.masked, self.eod = task.masked, task.eod
        self.per_sample = task.per_sample // split.size

    def inputs(self, batch: dict) -> torch.Tensor:
        return self.split.part(self.task.inputs(batch))

    def documents(self, batch: dict, device=None):
        """What this worker's attending layers are told of a batch: every row's documents
        (found in the whole row; one a row without data.document_mask) as its part sees them."""
        from baton.models.documents import sequence_part

        docs = self.task.documents(batch, device)
        if docs is not None:
            return docs.part(self.split)
        tokens = self.task.inputs(batch)
        return sequence_part(self.split, *tokens.shape, device or tokens.device)

    def loss(self, output, batch):
        return loss_sum(output, self.split.part(self.task.labels(batch))), {}

    def count(self, batch: dict) -> torch.Tensor:
        return self.split.part(self.task.kept(batch)).sum()


class Classification(Task):
    """Cross-entropy over class logits (samples, classes); accuracy; at evaluation (no
    gradients), the AUROC too: of class 1's probability with two classes, else the mean of
    each class's against the rest (`macro_auroc`; up to MOST_AUROC_CLASSES classes). Counting
    scores a micro-batch and sending the counts with each step's result is no cost a training
    step needs (`benchmarks/eval_counts.py`: 4 micro-batches of 32 rows, then `Sums.out`
    pickled, on a 2-core EPYC: 569 us with the counts against 168 us without for 2 classes,
    697 against 185 for 10, 3.6 ms against 1.1 for 1,000; the result 727, 5,182 and 7,955
    bytes against 80, its counts sent sparse: 4,114, 40,206 and 408,180 sent whole)."""

    name, needs = "classification", ("inputs", "label")
    metrics = ("accuracy", "auroc")  # (auroc up to MOST_AUROC_CLASSES classes)

    def loss(self, output, batch):
        import torch
        import torch.nn.functional as F

        valid = batch[VALID]
        labels = batch["label"].masked_fill(~valid, IGNORE)
        ls = F.cross_entropy(output.float(), labels, reduction="sum", ignore_index=IGNORE)
        correct = ((output.argmax(-1) == labels) & valid).sum()
        metrics = {"accuracy": correct.float()}
        classes = output.shape[-1]
        if not torch.is_grad_enabled() and classes <= MOST_AUROC_CLASSES:
            probs = output.detach().float().softmax(-1)
            metrics["auroc"] = (auroc(probs[:, 1], labels == 1, valid) if classes == 2 else
                                macro_auroc(probs, labels, valid, 1000 if classes <= 100 else 100))
        return ls, metrics


class UserTask(Task):
    def __init__(self, name: str):
        self.name, self.fn = name, user_function(name)

    def loss(self, output, batch):
        import torch

        out = self.fn(output, batch)
        if not isinstance(out, dict) or not torch.is_tensor(out.get("loss")):
            got = type(out).__name__ if not isinstance(out, dict) else f"keys {sorted(map(str, out))}"
            raise TypeError(f"task {self.name} must return a dict with a tensor 'loss', got {got}")
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}


BUILT_IN = ("language_model", "classification")
_USER = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def make_task(spec, columns=None) -> Task:
    """The job's task; `columns`: what its workers read (data/feed.py's Columns, checked
    against the data before Ray started), where a language model's documents end."""
    if spec.task == "language_model":
        eod = columns.eod if columns is not None else spec.data.eod_token
        return LanguageModel(spec.model.seq_len, spec.data.loss_mask_column is not None,
                             eod if spec.data.document_mask else None)
    if spec.task == "classification":
        return Classification()
    return UserTask(spec.task)


def user_function(name: str) -> Callable:
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def task_problem(name: str) -> Optional[str]:
    """Why `name` names no task (None: it does). A user's module is imported here: its code runs."""
    if name in BUILT_IN:
        return None
    if not _USER.fullmatch(name):
        return f"use one of {', '.join(BUILT_IN)} or 'package.module:function'"
    module, _, func = name.partition(":")
    try:
        fn = user_function(name)
    except AttributeError:
        return f"module {module!r} has no {func!r}"
    except (Exception, SystemExit) as e:
        return f"cannot load the task: importing {module!r} raised {reason(e)}"
    return None if callable(fn) else f"{name} is {type(fn).__name__}, not a function"


def example_inputs(spec, shapes: dict, rows: int) -> torch.Tensor:
    """The model's input for `rows` padding rows: what shape probes and profiles run."""
    return make_task(spec).inputs(padded({}, rows, shapes))


def to_device(batch: dict, device: torch.device) -> dict:
    return {name: t.to(device) for name, t in batch.items()}


class Counts:
    """A metric of the whole set's scores: positive and negative rows counted by score bin
    (int64 tensors of one length), summed like every other metric, then read off the summed
    counts by `kind` (`auroc`, `average_precision`: `COUNTED`)."""

    def __init__(self, kind: str, positives: torch.Tensor, negatives: torch.Tensor):
        self.kind, self.positives, self.negatives = kind, positives, negatives

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(self.kind, self.positives + other.positives, self.negatives + other.negatives)

    def detach(self) -> "Counts":
        return Counts(self.kind, self.positives.detach(), self.negatives.detach())


def _binned(kind: str, scores: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
            bins: int) -> Counts:
    """The valid rows' `scores` (clamped to [0, 1]) counted into `bins` equal bins, positives
    (`labels` true) and negatives apart. No shape depends on the values (it runs on PyTorch's
    meta device in `baton validate`)."""
    if scores.shape != labels.shape or scores.shape != valid.shape:
        raise ValueError(f"{kind}: scores {tuple(scores.shape)}, labels {tuple(labels.shape)} and "
                         f"valid {tuple(valid.shape)} must have one shape (one score a row)")
    positives, negatives = _count(scores[:, None], labels.bool()[:, None], valid, bins)
    return Counts(kind, positives[0], negatives[0])


def _count(scores: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor,
           bins: int) -> list[torch.Tensor]:
    """Each column of `scores` (rows, columns) counted into `bins` bins of its own, over the
    valid rows: [positives, negatives], each (columns, bins), `positive` (rows, columns) saying
    which side a row's score counts on."""
    import torch

    columns = scores.shape[1]
    index = (scores.detach().float().clamp(0, 1) * bins).long().clamp(max=bins - 1)
    index = index + torch.arange(columns, device=scores.device) * bins  # each column its own bins
    valid = valid.bool()[:, None]
    return [torch.zeros(columns * bins, dtype=torch.int64, device=scores.device).scatter_add_(
        0, index.flatten(), (valid & side).long().flatten()).view(columns, bins)
        for side in (positive, ~positive)]


def auroc(scores: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, bins: int = 1000) -> Counts:
    """The area under the ROC curve of `scores` in [0, 1] (a probability: the sigmoid of a
    logit) against the bool `labels`, over the rows where `valid` is true, from the scores
    counted into `bins` equal bins: the trapezoids between the bins' edges, so rows whose
    scores share a bin count as ties (half). A metric of a task: `{"auroc": auroc(...)}`."""
    return _binned("auroc", scores, labels, valid, bins)


def average_precision(scores: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                      bins: int = 1000) -> Counts:
    """Average precision (the area under the precision-recall curve, as a sum of precision
    times each step of recall) of `scores` in [0, 1] against the bool `labels`, over the valid
    rows, with the bins' edges as thresholds."""
    return _binned("average_precision", scores, labels, valid, bins)


def macro_auroc(probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                bins: int = 1000) -> Counts:
    """The mean over the classes of each class's AUROC against the rest (one-vs-rest, a
    macro average: sklearn's `roc_auc_score(multi_class="ovr")`, torchmetrics'
    `MulticlassAUROC`) of `probs` (rows, classes) in [0, 1] (a softmax) against the int
    `labels`, over the valid rows: each class's scores counted into `bins` bins as `auroc`
    counts them. A class with no row of it (or no row of another) is left out of the mean."""
    return _binned_classes("macro_auroc", probs, labels, valid, bins)


def macro_average_precision(probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                            bins: int = 1000) -> Counts:
    """The mean over the classes of each class's average precision against the rest
    (sklearn's `average_precision_score` of the labels one-hot, `average="macro"`;
    torchmetrics' `MulticlassAveragePrecision`), counted as `macro_auroc` counts; a class
    with no row of it is left out of the mean."""
    return _binned_classes("macro_average_precision", probs, labels, valid, bins)


def _binned_classes(kind: str, probs: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                    bins: int) -> Counts:
    """Each class's scores (a column of `probs`) counted into `bins` bins of its own, its
    rows (`labels` that class) positives, the others negatives: (classes, bins) counts."""
    import torch

    rows, classes = probs.shape if probs.dim() == 2 else (None, None)
    if rows is None or labels.shape != (rows,) or valid.shape != (rows,):
        raise ValueError(f"{kind}: probs {tuple(probs.shape)} must be (rows, classes), labels "
                         f"{tuple(labels.shape)} and valid {tuple(valid.shape)} (rows,)")
    mine = labels[:, None] == torch.arange(classes, device=labels.device)
    return Counts(kind, *_count(probs, mine, valid, bins))


def _auroc_of(positives, negatives) -> Optional[float]:
    """From counts by bin (ascending scores): each negative outranked by every positive of a
    higher bin and half of those of its own (Mann-Whitney with ties in a bin)."""
    import numpy as np

    p, n = positives.sum(), negatives.sum()
    if not p or not n:
        return None  # no positive (or no negative) row: no curve
    above = np.cumsum(positives[::-1])[::-1] - positives  # positives in higher bins
    return float((negatives * (above + positives / 2)).sum() / (p * n))


def _average_precision_of(positives, negatives) -> Optional[float]:
    """Thresholds from the highest bin down: precision at each, times the recall it adds."""
    import numpy as np

    p = positives.sum()
    if not p:
        return None
    tp, fp = np.cumsum(positives[::-1]), np.cumsum(negatives[::-1])
    taken = tp + fp
    precision = np.divide(tp, taken, out=np.zeros(len(tp)), where=taken > 0)
    return float((positives[::-1] * precision).sum() / p)


def _macro(of: Callable) -> Callable:
    """The mean of each class's `of` (a row of counts a class), over the classes it has."""
    def mean(positives, negatives) -> Optional[float]:
        each = [a for a in map(of, positives, negatives) if a is not None]
        return sum(each) / len(each) if each else None
    return mean


def _busiest_of(chosen, passed) -> Optional[float]:
    """A mixture of experts' load (a row a block, an entry an expert: the tokens' choices
    that went to it, and those that went to the others): the busiest expert's share of its
    block's choices over an even share, 1 when balanced, up to experts / experts_per_token."""
    import numpy as np

    total = chosen + passed
    if not total.any():
        return None
    return float(np.max(np.divide(chosen, total, out=np.zeros(chosen.shape), where=total > 0))
                 * chosen.shape[-1])


COUNTED = {"auroc": _auroc_of, "average_precision": _average_precision_of,
           "macro_auroc": _macro(_auroc_of), "macro_average_precision": _macro(_average_precision_of),
           "expert_load": _busiest_of}
MOST_AUROC_CLASSES = 10_000  # a classifier's evaluation counts scores for its AUROC up to here


class Sums:
    """A step's (or an evaluation's) loss and metric sums, and how many terms they sum over:
    kept on the device until `out` (one read a step, not one a micro-batch). A ratio metric
    (a pair of sums) keeps its numerator and denominator apart; a macro average (a pair of
    vectors, one entry a class) keeps each class's."""

    def __init__(self):
        self.loss = self.count = 0
        self.targets = None  # a masked task's loss terms (`count` is then its tokens)
        self.metrics: dict = {}
        self.ratios: dict = {}  # name -> [numerator, denominator]
        self.counts: dict = {}  # name -> Counts

    def add(self, task: Task, loss: torch.Tensor, metrics: dict, batch: dict) -> None:
        self.loss = self.loss + loss.detach()
        self.add_metrics(metrics)
        self.count = self.count + batch[VALID].sum() * task.per_sample
        if task.masked:
            self.targets = (self.targets or 0) + task.count(batch)

    def add_metrics(self, metrics: dict) -> None:
        """Metrics alone (a pipeline stage's measures before the loss's stage)."""
        for k, v in metrics.items():
            if isinstance(v, (tuple, list)):
                num, den = self.ratios.get(k, (0, 0))
                self.ratios[k] = [num + v[0].detach(), den + v[1].detach()]
            elif isinstance(v, Counts):
                self.counts[k] = self.counts[k] + v.detach() if k in self.counts else v.detach()
            else:
                self.metrics[k] = self.metrics.get(k, 0) + v.detach()

    def out(self) -> dict:
        out = {"loss_sum": float(self.loss), "tokens": int(self.count),
               "metrics": {k: float(v) for k, v in self.metrics.items()}}
        if self.targets is not None:
            out["targets"] = int(self.targets)
        if self.ratios:
            out["ratios"] = {k: [_plain(num), _plain(den)] for k, (num, den) in self.ratios.items()}
        if self.counts:
            out["counts"] = {k: [c.kind, _sparse(c.positives), _sparse(c.negatives)]
                             for k, c in self.counts.items()}
        return out


def _sparse(counts: torch.Tensor) -> list:
    """Counts as sent: their shape, the flat places of those above 0, and those counts. A
    batch's rows fill few of the bins (at most a bin a row and class): sent whole, 10 classes'
    1,000 bins each were 20,000 numbers a batch whatever its rows."""
    flat = counts.flatten()
    at = flat.nonzero().flatten()
    return [list(counts.shape), at.tolist(), flat[at].tolist()]


def _dense(sent: list):
    """`_sparse`'s counts, whole again (a numpy array)."""
    import numpy as np

    shape, at, n = sent
    out = np.zeros(int(np.prod(shape)), dtype=np.int64)
    out[np.asarray(at, dtype=np.int64)] = n
    return out.reshape(shape)


def _plain(v) -> float | list[float]:
    """A sum as sent: a number, or a macro average's list of each class's."""
    return float(v) if not hasattr(v, "dim") or v.dim() == 0 else v.float().tolist()


def _zero(v: float | list) -> float | list:
    return [0.0] * len(v) if isinstance(v, list) else 0.0


def counted_once(out: dict) -> dict:
    """`Sums.out()` with every value 0 and the same keys: what a tensor-parallel worker other
    than its replica's first reports, since its sums are the first's (summed over the workers,
    they would count its replica tp times)."""
    zero = {"loss_sum": 0.0, "tokens": 0, "metrics": {k: 0.0 for k in out["metrics"]}}
    if "ratios" in out:
        zero["ratios"] = {k: [_zero(num), _zero(den)] for k, (num, den) in out["ratios"].items()}
    if "counts" in out:
        zero["counts"] = {k: [kind, [pos[0], [], []], [neg[0], [], []]]
                          for k, (kind, pos, neg) in out["counts"].items()}
    return zero


def metric_values(results: list[dict], count: float) -> dict[str, float]:
    """The task's metrics over `results` (each a `Sums.out()`, of a replica or a batch): each
    sum over the `count` valid terms, each ratio its numerators' sum over its denominators'
    (left out where the denominator is 0: no positive rows, say, make no precision), each
    macro average the mean of its classes' ratios of sums over the classes whose denominator
    is above 0, each counted metric read off the summed counts (left out where it has no
    value)."""
    import numpy as np

    values = {k: sum(r.get("metrics", {}).get(k, 0.0) for r in results) / count
              for k in {k for r in results for k in r.get("metrics", {})}}
    for k in {k for r in results for k in r.get("ratios", {})}:
        num, den = (np.sum([np.asarray(r["ratios"][k][i], dtype=np.float64) for r in results
                            if k in r.get("ratios", {})], axis=0) for i in (0, 1))
        seen = den > 0
        if seen.any():
            values[k] = float(np.mean(num[seen] / den[seen]))
    for k in {k for r in results for k in r.get("counts", {})}:
        parts = [r["counts"][k] for r in results if k in r.get("counts", {})]
        positives, negatives = (np.sum([_dense(c[i]) for c in parts], axis=0) for i in (1, 2))
        value = COUNTED[parts[0][0]](positives, negatives)
        if value is not None:
            values[k] = value
    return values


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy; callers divide by the global token count. Logits
    split by vocabulary over tensor-parallel workers (`vocab_split`) are taken as they are."""
    import torch.nn.functional as F

    if getattr(logits, "vocab_split", None) is not None:
        from baton.parallel.tensor import vocab_cross_entropy_sum

        return vocab_cross_entropy_sum(logits, targets, IGNORE)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE)


def padded(batch: dict, rows: int, shapes: dict) -> dict:
    """`batch` with padding rows appended up to `rows` (zeros, VALID False); `shapes`: each
    column's (row shape, dtype), for a batch with no rows at all."""
    import torch

    have = len(batch[VALID]) if VALID in batch else 0
    if have >= rows:
        return batch
    out = {}
    for name, (shape, dtype) in shapes.items():
        pad = torch.zeros((rows - have, *shape), dtype=dtype)
        out[name] = torch.cat([batch[name], pad]) if name in batch else pad
    valid = batch.get(VALID, torch.zeros(0, dtype=torch.bool))
    out[VALID] = torch.cat([valid, torch.zeros(rows - have, dtype=torch.bool)])
    return out
