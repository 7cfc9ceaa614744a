"""`baton validate`: a job file checked, with its data, and what it would do said without
training (the world, the data, the layout each worker holds)."""

from __future__ import annotations

import argparse


def validate(args: argparse.Namespace) -> int:
    """Check a job file (and its data) without training; say what it would do."""
    from baton import api

    spec, data = api.validate(args.job, args.set)
    d = spec.parallel
    task = f"{spec.task}, " if spec.task != "language_model" else ""
    print(f"{args.job}: ok ({spec.name}: {task}{spec.model.name}, dp={d.dp} pp={d.pp}"
          f"{f' tp={d.tp}' if d.tp > 1 else ''}{f' cp={d.cp}' if d.cp > 1 else ''}, "
          f"{spec.train.steps} steps of {spec.train.global_batch} samples)")
    if data is not None:
        m = data.manifest.summary()
        for line in _data_lines(m, spec.data.shuffle_block, [s.path for s in spec.data.mix]):
            print(line)
        if spec.data.loss_mask_column:
            print(f"  targets: the tokens {spec.data.loss_mask_column!r} marks 1 (the loss is "
                  "their mean over each batch; the other tokens are context)")
        if data.columns.eod is not None:
            print(f"  documents: each attends to itself alone, its positions counted from its "
                  f"start (data.document_mask; a document ends at token {data.columns.eod})")
        if spec.task != "language_model":
            print("  columns: " + ", ".join(
                f"{f.name} <- {'+'.join(f.sources)} ({f.dtype}{list(f.shape) if f.shape else ''})"
                for f in data.columns.fields))
        if data.eval_sets:
            e = spec.eval
            held = sum(len(s.uids) for s in data.eval_sets) if e.fraction else 0
            print(f"  eval: {data.eval_samples:,} held-out samples "
                  + (f"({held} of {m['row_groups']} row groups"
                     f"{', some of each source' if spec.data.mix else ''}, eval.seed {e.seed})"
                     if e.fraction else f"from {e.path}")
                  + (f", every {e.every_steps} steps and" if e.every_steps else "") + " at the end"
                  + (f"; the best checkpoint by {spec.checkpoint.best} "
                     f"({'lowest' if spec.checkpoint.best_lowest else 'highest'}) kept"
                     if spec.checkpoint.best else "")
                  + (f"; stops after {e.patience} evaluation{'s' * (e.patience > 1)} without "
                     f"an improvement" + (f" larger than {e.min_delta:g}" if e.min_delta else "")
                     if e.patience else ""))
    from baton.checkpoint.export import is_export, pretrained_about, read_about
    from baton.storage import redact

    start = spec.model.init_from
    if start and is_export(start):
        about = read_about(start)
        print(f"  starts from {redact(start)}: step {about.get('step')} of "
              f"{about.get('job')} ({about.get('parameters', 0):,} parameters)")
    elif start and spec.model.name == "llama" and pretrained_about(start):
        print(f"  starts from {redact(start)}: a save_pretrained folder of a "
              f"{pretrained_about(start)['pretrained']} model")
    else:
        start = None
    if start and spec.model.init_fresh:
        print(f"  fresh (its own initialization): {api.fresh_names(spec)}")
    if start and spec.model.init_grow:
        print(f"  grown (the export's rows first): {api.grown_names(spec)}")
    if spec.model.partly_frozen:
        print(f"  {_frozen_line(spec)}")
    if d.pp > 1:
        print(f"  pipeline: {d.schedule}, {spec.microbatches} micro-batches of "
              f"{spec.micro_batch} per replica, {spec.chunks} chunk(s) per rank, layers per "
              f"stage {api.stage_plan(spec)}")
    if d.shard != "none" and d.tp == 1:
        print(f"  {_sharding_line(spec)}")
    if d.tp > 1:
        print(f"  {_tensor_line(spec)}")
    if d.ep > 1:
        print(f"  {_experts_line(spec)}")
    if d.cp > 1:
        print(f"  {_context_line(spec)}")
    guards = _guards(spec)
    if guards:
        print(f"  guards: {guards}")
    lo, hi = spec.dp_range
    e = spec.elastic
    if lo < hi or e.max_failures:
        print(f"  elastic: dp {spec.valid_dps()} ({spec.batch_policy}), recovers from up to "
              f"{e.max_failures} failures, looks for room every {e.rescale_check_s:g} s, a "
              f"worker silent for {e.hang_timeout_s:g} s is dead"
              + ("; after a loss it goes on with the survivors" if e.recovery == "continue" else ""))
    return 0


def _guards(spec) -> str:
    """What the job does about bad steps and bad rows instead of stopping, where it says."""
    t, said = spec.train, []
    if t.skip_nonfinite:
        said.append(f"up to {t.skip_nonfinite} step{'s' * (t.skip_nonfinite > 1)} in a row whose "
                    "gradient is not finite skipped")
    if t.rewind_on_spike:
        r = t.rewind_on_spike
        said.append(f"a loss above {r.factor:g}x the median of the {r.window} steps before it "
                    f"rewound past, up to {r.most} time{'s' * (r.most > 1)}")
    if spec.data.skip_bad_row_groups:
        n = spec.data.skip_bad_row_groups
        said.append(f"up to {n} row group{'s' * (n > 1)} with bad rows left out")
    return "; ".join(said)


def _sharding_line(spec) -> str:
    """The layout of a sharded job and the state each worker holds, next to DDP's."""
    from baton.models import adapted_on_meta, layer_params, sequential
    from baton.models.frozen import counts
    from baton.parallel.partition import bounds, plan_stages
    from baton.parallel.schedule import stage_of
    from baton.parallel.sharding import NAMES, estimate_bytes

    d, dims = spec.parallel, spec.dims()
    shards = dims.shards  # (a replica's cp workers split its state too)
    held = [counts(layer) for layer in sequential(adapted_on_meta(spec.model), spec.model.name)]
    trained, n = map(sum, zip(*held))
    if d.pp > 1:  # the pipeline rank with the most parameters (partition: time, estimated so)
        spans = bounds(plan_stages(spec, lambda: layer_params(spec.model)))

        def on_rank(r: int) -> tuple[int, int]:  # (parameters, trained) of its chunks' layers
            mine = [h for c in range(spec.chunks) for h in held[slice(*spans[stage_of(r, c, d.pp)])]]
            return sum(h[1] for h in mine), sum(h[0] for h in mine)
        n, trained = max(map(on_rank, range(d.pp)))
    averaged = spec.train.ema is not None
    mine, ddp = (estimate_bytes(n, d.shard, shards, averaged, trained),
                 estimate_bytes(n, "none", 1, averaged, trained))
    groups = dims.dp_replicate
    of = (f" ({dims.dp_shard} replica{'s' * (dims.dp_shard > 1)} x {d.cp} cp workers)"
          if dims.sharded_cp else "")
    layout = (f"{groups} replica groups of {shards}{of} (hybrid)" if groups > 1
              else f"{shards} workers{of}")
    if d.pp > 1:
        layout += f" in each of {d.pp} pipeline stages (the largest stage's share)"
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    return (f"sharding: {d.shard} ({NAMES[d.shard]}) over {layout}; per worker: "
            + ", ".join(f"{k} {mib(v)}" for k, v in mine.items())
            + f" = {mib(sum(mine.values()))} (DDP: {mib(sum(ddp.values()))})")


def _experts_line(spec) -> str:
    """What each worker holds under expert parallelism, next to a whole replica."""
    from baton.models import _on_meta, routed
    from baton.parallel.experts import held
    from baton.parallel.sharding import NAMES, estimate_bytes

    d, model = spec.parallel, _on_meta(spec.model)
    blocks = routed(model)
    total = sum(q.numel() for q in model.parameters())
    if d.tp > 1:  # (each worker's share of every layer, of each expert too)
        from baton.parallel.tensor import split_layers

        split_layers(model, 0, d.tp, None)
    here = sum(q.numel() for q in model.parameters())
    split = sum(q.numel() for _, q in held(model))
    # under ZeRO the rest of the model is sharded over the workers that split the experts
    shards = spec.dims().shards if d.shard != "none" else 1
    mine = (here - split) // shards + split // d.ep
    mib = lambda n, level="none", k=1: sum(estimate_bytes(n, level, k).values()) / 2**20  # noqa: E731
    held_mib = mib(here - split, d.shard, shards) + mib(split // d.ep)
    groups = d.dp // d.ep
    return (f"expert parallel: the {blocks[0].mixture.experts} experts of each of {len(blocks)} "
            f"blocks split over {d.ep} workers ({blocks[0].mixture.experts // d.ep} each"
            + (f", 1/{d.tp} of each one's hidden units on each tp worker" if d.tp > 1 else "")
            + (f"; {groups} groups, each expert's gradient summed over its {groups} holders" if groups > 1 else "")
            + f"); per {'worker' if d.pp == 1 else f'replica (its {d.pp} stages together)'} "
            f"{mine:,} of the {total:,} parameters"
            + (f" (the rest sharded over {shards}: {NAMES[d.shard]})" if shards > 1 else "")
            + f": {held_mib:,.1f} MiB of parameters, gradients and optimizer state "
            f"(DDP: {mib(total):,.1f} MiB)")


def _context_line(spec) -> str:
    """How context parallelism splits each row, and what crosses between the workers."""
    from baton.models import _on_meta

    d, T = spec.parallel, spec.model.seq_len
    block = next(m for m in _on_meta(spec.model).modules() if hasattr(m, "cp_problem"))
    kv = getattr(block, "kv_heads", block.heads)
    ways = d.cp * d.tp  # (under tensor parallelism a cp worker holds a tp-th of the heads)
    heads = f"{block.heads // ways} of the {block.heads} query heads" + (
        f" and {kv // ways} of the {kv} key-value heads" if kv != block.heads else "")
    attend = (f"attention over all {T:,} for {heads} on each (two all-to-alls a block, and two "
              "in its backward)")
    mine = f"{block.heads // d.tp} query heads" if d.tp > 1 else "every query head"
    if d.cp_attention == "all_gather":
        attend = (f"attention of its positions, {mine}, over all {T:,} positions' keys and "
                  f"values (one all-gather a block, a reduce-scatter in its backward)")
    if d.cp_attention == "ring":
        attend = (f"attention of its positions, {mine}, over each worker's keys and values in "
                  f"turn, passed around a ring ({d.cp - 1} sends a block, {d.cp} more with their "
                  f"gradients in its backward)")
    # (a ring worker's positions: two pieces, i and 2cp - 1 - i, so that each sees as many keys)
    pieces = (f" in two pieces of {T // (2 * d.cp):,}, the zigzag order" if d.cp_attention == "ring"
              else "")
    part = " and ".join(name for name, n in (("stage", d.pp), ("tp share", d.tp)) if n > 1)
    held = (f"each {part}'s gradients are summed over the {d.dp * d.cp} workers holding it" if part
            else f"every parameter's gradient is summed over all {d.dp * d.cp} workers" + (
                f" (each expert's over the {d.dp // d.ep * d.cp} holding it)" if d.ep > 1 else ""))
    return (f"context parallel: each row's {T:,} positions split over {d.cp} workers "
            f"({T // d.cp:,} each{pieces}, embedded, run and scored there); {attend}; a "
            f"replica's {d.cp * d.tp} workers read the same rows, and {held}")


def _frozen_line(spec) -> str:
    """What model.lora adapts, or model.frozen freezes, and how much of the model trains."""
    from baton.models import adapted_on_meta, frozen
    from baton.models.lora import adapted_layers

    m = spec.model
    model = adapted_on_meta(m)
    names = list(adapted_layers(model, m)) if m.lora is not None else []
    trained, total = frozen.counts(model)
    whole = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n]
    some = lambda xs: ", ".join(xs[:6]) + (f", ... ({len(xs)} in all)" if len(xs) > 6 else "")  # noqa: E731
    share = f"trains {trained:,} of {total:,} parameters ({trained / total:.2%})"
    if m.lora is None:
        return f"frozen: {', '.join(m.frozen)}; {share}: {some(whole)}{_left_out(m, model)}"
    more = (", rsLoRA" if m.lora.rslora else "") + (f", dropout {m.lora.dropout:g}" if m.lora.dropout else "")
    return (f"adapters (LoRA rank {m.lora.rank}, alpha {m.lora.alpha:g}{more}) on {len(names)} linear "
            f"layers: {some(names)}; {share}" + (f", {some(whole)} whole" if whole else "")
            + _left_out(m, model))


def _left_out(m, model) -> str:
    """What the job's checkpoints leave out (checkpoint/frozen.py: `model`, built on meta,
    counts it), said after what trains."""
    from baton.models.frozen import from_start
    from baton.storage import redact

    left_out = set(from_start(m))
    count = sum(p.numel() for n, p in model.named_parameters() if n in left_out)
    return (f"; its checkpoints leave out the {count:,} frozen ones (they stay in "
            f"{redact(m.init_from)})" if left_out else "")


def _tensor_line(spec) -> str:
    """What each tensor-parallel worker holds of the model (and of that, under sharding, its
    shard), next to a whole replica."""
    from baton.models import adapted_on_meta
    from baton.models.frozen import counts
    from baton.parallel.sharding import NAMES, estimate_bytes
    from baton.parallel.tensor import split_layers

    d = spec.parallel
    model = adapted_on_meta(spec.model)
    whole = counts(model)
    splits = split_layers(model, 0, d.tp, None)
    trained, mine = counts(model)
    averaged = spec.train.ema is not None
    shards = spec.dims().shards  # (with cp: each replica's cp workers split its state too)
    held = sum(estimate_bytes(mine, d.shard, shards, averaged, trained).values())
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731 (fp32 parameters, gradients, AdamW's two moments)
    sharded = (f", {d.shard} ({NAMES[d.shard]}) over the {shards} workers holding each share"
               if d.shard != "none" else "")
    return (f"tensor parallel: {len({n.rsplit('.', 1)[0] for n in splits})} layers split "
            f"over {d.tp} workers{sharded}; per worker {mine:,} of the {whole[1]:,} "
            f"parameters: {mib(held)} of parameters, gradients and optimizer state (whole: "
            f"{mib(sum(estimate_bytes(whole[1], 'none', 1, averaged, whole[0]).values()))})")


def _data_lines(m: dict, shuffle_block: int, mixed: list[str]) -> list[str]:
    """`baton validate`'s lines about the training corpus, or each source of a mix."""
    def shape(m: dict) -> str:
        blocks = -(-m["samples"] // shuffle_block)
        return (f"{m['samples']:,} samples in {m['row_groups']} row groups of {m['files']} files "
                f"({m['bytes'] / 2**20:,.1f} MiB), manifest {m['digest']}; "
                + ("a full permutation each epoch" if blocks == 1 else
                   f"shuffled in {blocks} blocks of {shuffle_block:,} samples"))
    if not mixed:
        return [f"  data: {shape(m)}"]
    return [f"  data: a mix of {len(mixed)} sources, manifest {m['digest']}"] + [
        f"    {s['weight']:.1%} of the samples from {path}: {shape(s)}"
        for path, s in zip(mixed, m["sources"])] + [
        f"    after step {p['after_step']}: " + ", ".join(f"{w:.1%}" for w in p["weights"])
        + f" (data.mix_phases[{k}], in the sources' order)" for k, p in enumerate(m.get("phases", []))]
