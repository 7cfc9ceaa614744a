"""A checkpoint as a model anyone can load (`baton export`): the parameters of a committed,
verified checkpoint, whatever layout wrote it (a file per pipeline stage, DCP shards, tensor
parallel pieces), as whole tensors under their names in the model, in safetensors files.

The folder it writes is Hugging Face's layout: `model.safetensors`, or, past `max_shard_bytes`,
`model-00001-of-0000N.safetensors` with `model.safetensors.index.json` (which file holds each
tensor); and `baton.json` (the job, the step, the model's section of the job file). An `hf:`
model's folder is also a `save_pretrained` one (its `config.json`, the names transformers
gives its parameters), so `AutoModelForCausalLM.from_pretrained` and `model.init_from` load
it; and so is the built-in GPT's with `hf=True` (`baton export --hf`): it is GPT-2's
architecture (pre-norm blocks, learned positions, a fused q/k/v projection, an untied head
without bias; exact GELU, which GPT-2's configuration names "gelu"), written under
`GPT2LMHeadModel`'s names, its linear weights transposed to GPT-2's `Conv1D` layout, with a
`config.json` written here (no transformers needed to export). `load_model` builds the
model again and loads it, in either form.

Memory: a sharded checkpoint is read about a file's worth of whole tensors at a time, and a
per-stage one a stage at a time, so exporting a model larger than this machine's memory
needs the room of one stage (or two files), not of the model. The files are written in a
folder beside `out` and renamed into place once all of them are: `out` is whole or absent.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import posixpath
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import pyarrow.fs as pafs
import torch

from baton import storage
from baton.checkpoint import frozen, tensorfile
from baton.checkpoint.store import CheckpointStore
from baton.errors import CheckpointError, StoreUnavailable
from baton.models import HF_PREFIX, llama
from baton.models.frozen import named
from baton.spec import JobSpec, ModelSpec
from baton.storage import redact

MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default (save_pretrained's max_shard_size "5GB")
SINGLE, INDEX, ABOUT = "model.safetensors", "model.safetensors.index.json", "baton.json"
HF_NAMES = "model."  # an hf: model's parameters are its transformers model's, under HFModel.model


def export(spec: JobSpec, out: str, step: Optional[int | str] = None,
           max_shard_bytes: int = MAX_SHARD_BYTES, log: Optional[Callable[[str], None]] = None,
           hf: bool = False, ema: bool = False, adapters: bool = False) -> dict:
    """Write checkpoint `step` of `spec`'s job (default: the newest that verifies; "best": the
    one `checkpoint.best` kept) to the folder `out` (a local path or a URI: `s3://...`), which
    must not exist; returns what `baton.json` says, with the files. `hf`: the built-in GPT as
    Hugging Face's GPT-2 (an hf: model is in its form anyway). `ema`: the average of the
    weights `train.ema` kept, in place of the weights (each parameter that trains; a frozen
    one's weights are its average). `adapters`: `model.lora`'s adapters alone, as PEFT's
    adapter folder (`adapter_model.safetensors`, `adapter_config.json`), for the model the
    job started from, under the names of the form `hf` says (`_write_adapters`)."""
    # whose names the files use: baton's, transformers' (an hf: model's), or a built-in
    # model's Hugging Face form's (GPT-2's, Llama's)
    form = FORMS.get(spec.model.name) if hf else None
    names = ("transformers" if spec.model.name.startswith(HF_PREFIX)
             else form.names if form else "baton")
    if hf and names == "baton":
        raise CheckpointError(f"--hf: model {spec.model.name!r} has no Hugging Face form; the "
                              "built-in gpt (as GPT-2), llama (as Llama, Qwen2 or Qwen3) and "
                              "hf: models do")
    try:
        config = form.config(spec.model) if form and not adapters else None
    except ValueError as e:
        raise CheckpointError(f"--hf: {e}") from None
    if adapters:
        _can_split(spec)
    target = _Out(out)
    store = CheckpointStore(spec.checkpoint_dir)
    step = pick(spec, store, step, log or (lambda line: print(line, file=sys.stderr)))
    model = spec.to_dict()["model"]
    if adapters:
        about = {"job": spec.name, "step": step, "model": model, "task": spec.task,
                 "checkpoint": store.step_dir(step), "names": names,
                 **({"weights": "ema"} if ema else {})}
        target.begin()
        try:
            return _write_adapters(spec, target, _tensors(store, step, max_shard_bytes, ema, _adapter),
                                   names, about)
        except BaseException:
            target.abandon()
            raise
    tensors = _tensors(store, step, max_shard_bytes, ema)
    checkpoint = store.read_meta(step)
    if frozen.left_out(checkpoint):  # the frozen parameters it leaves out: the export's
        tensors = itertools.chain(tensors, frozen.read(checkpoint, spec.model,
                                                       frozen.left_out(checkpoint)))
    if spec.model.lora is not None:  # the adapters merged: a model like any other
        tensors = _merged(spec, tensors)
        del model["lora"]
    about = {"job": spec.name, "step": step, "model": model,
             "task": spec.task, "tokens": _tokens(spec), "checkpoint": store.step_dir(step),
             "names": names, **({"weights": "ema"} if ema else {})}
    meta = {"format": "pt", "baton.job": spec.name, "baton.step": str(step)}
    target.begin()
    try:
        files, where, total, count = [], {}, 0, 0
        for group in _files(tensors, max_shard_bytes):
            name = f"part-{len(files):05d}.safetensors"
            if names == "transformers":
                group = {n[len(HF_NAMES):] if n.startswith(HF_NAMES) else n: t for n, t in group.items()}
            elif form:
                group = dict(form.to_hf(n, t, spec.model) for n, t in group.items())
            with target.fs.open_output_stream(target.file(name)) as f:
                tensorfile.write(f, group, meta)
            files.append(name)
            for n, t in group.items():
                where[n] = name
                total += t.numel() * t.element_size()
                count += t.numel()
        final = _final_names(len(files))
        for old, new in zip(files, final):
            target.fs.move(target.file(old), target.file(new))
        if len(final) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: final[files.index(f)] for n, f in sorted(where.items())}}
            target.write(INDEX, json.dumps(index, indent=1))
        if names == "transformers":
            from baton.models.hf import _config

            target.write("config.json", _config(spec.model).to_json_string(use_diff=True))
        elif form:
            target.write("config.json", json.dumps(config, indent=1))
        about.update(files=final, parameters=count, bytes=total)
        target.write(ABOUT, json.dumps(about, indent=1))  # last: an export without it is none
        target.done()
    except BaseException:
        target.abandon()
        raise
    return about


def located(folder: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of an export's folder and its path there: a URI (`s3://...`), or a local
    path as given (from the working directory)."""
    if storage.is_uri(folder):
        return storage.resolve(folder)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(folder))


class _Out:
    """The folder an export is written to, whole or absent: on a local disk the files go into
    a folder beside it that is renamed into place at the end; on object storage (no renames
    of folders) into the folder itself, `baton.json` last, since an export is read from its
    `baton.json` and one without it is refused; a failed export's files are deleted."""

    def __init__(self, out: str):
        self.fs, self.final = located(out)
        self.local = storage.is_local(self.fs)
        if storage.exists(self.fs, self.final):
            raise CheckpointError(f"{redact(out)} already exists; choose a new --out")
        head, tail = posixpath.split(self.final)
        self.dir = f"{head}/.{tail}.tmp-{os.getpid()}" if self.local else self.final

    def begin(self) -> None:
        if self.local:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.fs.create_dir(self.dir, recursive=True)

    def file(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def write(self, name: str, text: str) -> None:
        storage.write_bytes(self.fs, self.file(name), text.encode())

    def done(self) -> None:
        if self.local:
            os.replace(self.dir, self.final)

    def abandon(self) -> None:
        if self.local:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        with contextlib.suppress(OSError):  # (what is left has no baton.json: not an export)
            self.fs.delete_dir(self.final)


def _tokens(spec: JobSpec) -> Optional[dict]:
    """How the job's corpus was tokenised, as `baton data prepare` recorded it (its
    `_corpus.json`: the tokenizer, `bytes` or a `module:function`, and the end-of-document
    token), for `baton sample`; None for a corpus written otherwise, or not readable here."""
    from baton.data.text import tokenised_by

    if spec.task != "language_model":
        return None
    return tokenised_by(spec.data.paths[0])  # (a mix's sources share one: data/source.py)


def _best(spec: JobSpec, store: CheckpointStore) -> int:
    c = spec.checkpoint
    if c.best is None:
        raise CheckpointError(f"--best: job {spec.name!r} sets no checkpoint.best (the held-out "
                              "metric to keep the best checkpoint by); give --step N")
    found = store.best(c.best, c.best_lowest)
    if found is None:
        raise CheckpointError(f"--best: no checkpoint in {store.root} records {c.best} (each "
                              "records its held-out evaluation once checkpoint.best is set)")
    return found[0]


def pick(spec: JobSpec, store: CheckpointStore, step: Optional[int | str],
         log: Callable[[str], None], verify: Optional[Callable] = None,
         doing: str = "exporting") -> int:
    """`step` ("best": the one checkpoint.best kept) if it is committed and verifies, else one
    line why not; without `step`, the newest committed checkpoint that verifies (each newer
    one that does not named). `verify`: how its parts are checked (`store.verify`'s; the
    default reads them all)."""
    if step == "best":
        step = _best(spec, store)
    where = store.root
    if step is not None:
        if step not in store.committed_steps():
            have = store.committed_steps()
            raise CheckpointError(f"{where} has no committed checkpoint {step}"
                                  + (f"; it has {', '.join(map(str, sorted(have)))}" if have else ""))
        problem = store.verify(step, verify)
        if problem:
            raise CheckpointError(f"checkpoint {step} in {where} does not verify: {problem}")
        return step
    found, failed = store.latest_verified(verify)
    for bad, why in failed:
        log(f"baton: checkpoint {bad} does not verify ({why}); {doing} an older one")
    if found is None:
        if failed:
            raise CheckpointError(store.none_verifies(failed))
        raise CheckpointError(f"{where} holds no committed checkpoint; train the job first")
    return found


def _tensors(store: CheckpointStore, step: int, most: int, ema: bool = False,
             keep: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter: a stage's file at a time, or shards read
    `most` bytes of whole tensors at a time. `ema`: each one's average (`train.ema`) where
    the checkpoint holds one (a frozen parameter has none); a checkpoint without them is refused.
    `keep`: the names to read (the rest are not read where the checkpoint is sharded)."""
    if not store.is_sharded(step):
        seen = False
        for i in range(store.read_meta(step)["layout"]["pp"]):
            tensors = {n: t for n, t in store.read_tensors(step, f"model-{i:04d}.pt").items() if keep(n)}
            if ema:  # (a stage whose parameters are all frozen has no optimizer state)
                state = store.read_tensors(step, f"optim-{i:04d}.pt")["state"]
                _averaged(store, step, all("ema" in s for s in state.values()))
                seen = seen or bool(state)
                tensors = {n: state.get(n, {}).get("ema", t) for n, t in tensors.items()}
            yield from tensors.items()
        if ema:
            _averaged(store, step, seen)
        return
    from baton.checkpoint import sharded

    where = store.shards(step)
    averages = {n[:-len(".ema")] for n in sharded.tensor_sizes(where, "optim") if n.endswith(".ema")}
    if ema:
        _averaged(store, step, bool(averages))

    def read(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = sharded.read_some(where, "model", names)
        if ema and averages.intersection(names):
            got = sharded.read_some(where, "optim", [f"{n}.ema" for n in names if n in averages])
            tensors.update({n: s["ema"] for n, s in got.items()})
        return iter(tensors.items())

    batch, held = [], 0
    for name, nbytes in sharded.tensor_sizes(where, "model").items():
        if not keep(name):
            continue
        batch.append(name)
        held += nbytes * (2 if ema and name in averages else 1)
        if held >= most:
            yield from read(batch)
            batch, held = [], 0
    if batch:
        yield from read(batch)


def _averaged(store: CheckpointStore, step: int, holds: bool) -> None:
    if not holds:
        raise CheckpointError(f"--ema: checkpoint {step} in {store.root} holds no average of the "
                              "weights (train.ema was not set when it was written); export it "
                              "without --ema, or train on with train.ema set")


def _merged(spec: JobSpec, tensors: Iterator[tuple[str, torch.Tensor]]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors with `model.lora`'s adapters merged into the weights they adapt."""
    from baton.models import _on_meta
    from baton.models.lora import adapted_layers, merged

    return merged(tensors, spec.model.lora, adapted_layers(_on_meta(spec.model), spec.model))


def _adapter(name: str) -> bool:
    from baton.models.lora import A, B

    return name.endswith((f".{A}", f".{B}"))


def _can_split(spec: JobSpec) -> None:
    """Refuse `--adapters` for a job whose adapters are not all it trained."""
    from baton.models import _on_meta
    from baton.models.frozen import trains

    if spec.model.lora is None:
        raise CheckpointError(f"--adapters: job {spec.name!r} trains no adapters (model.lora); "
                              "export its model without --adapters")
    whole = [n for n, _ in _on_meta(spec.model).named_parameters() if trains(n, spec.model)]
    if whole:
        raise CheckpointError(
            f"--adapters: job {spec.name!r} also trains {len(whole)} parameters whole "
            f"({_some(whole, 3)}: model.lora.whole, init_fresh or init_grow), which an adapter "
            "folder does not hold; export the merged model (without --adapters)")


def _write_adapters(spec: JobSpec, target: "_Out", tensors: Iterator[tuple[str, torch.Tensor]],
                    names: str, about: dict) -> dict:
    """`model.lora`'s adapters as PEFT writes a LoRA adapter: `adapter_model.safetensors` with
    `base_model.model.<layer>.lora_A.weight` (A, rank x in) and `lora_B.weight` (B, out x
    rank), and `adapter_config.json` (rank, alpha, the layers); `<layer>` named as the form
    `names` names the model (baton's, transformers', or GPT-2's, whose Conv1D layers PEFT
    adapts with `fan_in_fan_out`: A and B have the same shapes there). PEFT's
    `PeftModel.from_pretrained(base, folder)` puts them on the model the job started from
    (`model.init_from`, exported in that form) and computes what the job's adapted model does."""
    from baton.models import _on_meta
    from baton.models.lora import PEFT_CONFIG, PEFT_WEIGHTS, adapted_layers, peft_key, peft_names

    lora = spec.model.lora
    layers = adapted_layers(_on_meta(spec.model), spec.model)  # name -> held as (in, out)
    theirs = {mine: name for name, mine in peft_names(layers, spec.model)[names].items()}
    out, total, count = {}, 0, 0
    for name, t in tensors:
        layer, _, part = name.rpartition(".")
        out[peft_key(theirs[layer], part)] = t.contiguous()
        total, count = total + t.numel() * t.element_size(), count + t.numel()
    if len(out) != 2 * len(layers):
        raise CheckpointError(f"checkpoint {about['step']} holds {len(out)} adapter tensors, "
                              f"{2 * len(layers)} expected ({len(layers)} adapted layers)")
    conv1d = names == "transformers" and any(layers.values()) or names == "gpt2"
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if names != "baton" else None,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": sorted(theirs.values()),
              # (GPT-2's Conv1D layers hold their weight as (in, out))
              "fan_in_fan_out": conv1d, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "use_rslora": lora.rslora, "use_dora": False,
              "base_model_name_or_path": spec.model.init_from and redact(spec.model.init_from)}
    with target.fs.open_output_stream(target.file(PEFT_WEIGHTS)) as f:
        tensorfile.write(f, dict(sorted(out.items())), {"format": "pt", "baton.job": spec.name,
                                                         "baton.step": str(about["step"])})
    target.write(PEFT_CONFIG, json.dumps(config, indent=1))
    about.update(adapters={"rank": lora.rank, "alpha": lora.alpha, "layers": len(layers)},
                 files=[PEFT_WEIGHTS], parameters=count, bytes=total)
    target.write(ABOUT, json.dumps(about, indent=1))  # last: an export without it is none
    target.done()
    return about


def _files(tensors: Iterator[tuple[str, torch.Tensor]], most: int) -> Iterator[dict]:
    """The tensors in groups of at most `most` bytes (a larger tensor alone), in order."""
    group, held = {}, 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        if group and held + size > most:
            yield group
            group, held = {}, 0
        group[name] = t
        held += size
    if group:
        yield group


def _final_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# The built-in GPT's block parameters under GPT-2's names: (baton's layer, GPT-2's, whose
# weight is transposed: GPT-2's Conv1D holds (in, out))
_BLOCK = {"ln1": ("ln_1", False), "qkv": ("attn.c_attn", True), "proj": ("attn.c_proj", True),
          "ln2": ("ln_2", False), "fc": ("mlp.c_fc", True), "out": ("mlp.c_proj", True)}


def gpt2_name(name: str, model: ModelSpec) -> tuple[str, bool]:
    """One of the built-in GPT's parameter names as GPT2LMHeadModel names it, and whether
    GPT-2 holds it transposed."""
    index, layer, kind = name.split(".")
    index = int(index)
    if index == 0:
        return f"transformer.{dict(tok='wte', pos='wpe')[layer]}.{kind}", False
    if index == model.layers + 1:
        return ("lm_head.weight" if layer == "lm" else f"transformer.ln_f.{kind}"), False
    theirs, transposed = _BLOCK[layer]
    return f"transformer.h.{index - 1}.{theirs}.{kind}", transposed and kind == "weight"


def gpt2_config(model: ModelSpec) -> dict:
    """The built-in GPT as GPT-2's configuration (what `GPT2Config.to_dict` writes, less what
    its defaults already say)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": model.vocab_size, "n_positions": model.seq_len, "n_embd": model.width,
            "n_layer": model.layers, "n_head": model.heads, "n_inner": 4 * model.width,
            "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": model.dropout,
            "tie_word_embeddings": False, "scale_attn_weights": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


@dataclass(frozen=True)
class Form:
    """A built-in model's Hugging Face form (`baton export --hf`): what `baton.json` calls
    it, each parameter's name there (and whether it is held transposed), its config.json."""
    names: str
    name: Callable[[str, ModelSpec], tuple[str, bool]]  # (baton's name, the model) -> (theirs, transposed)
    config: Callable[[ModelSpec], dict]
    # a save_pretrained folder's config.json -> {"model": the job's model section, "tied":
    # {a parameter: the one whose tensor it starts as}, "window": a sliding window or None,
    # "window_layers": the first layer that keeps to it, where not every layer does}
    from_config: Optional[Callable[[dict], dict]] = None
    model_types: tuple[str, ...] = ()  # the config.json model_types from_config reads

    def to_hf(self, name: str, t: torch.Tensor, model: ModelSpec) -> tuple[str, torch.Tensor]:
        theirs, transposed = self.name(name, model)
        return theirs, t.t() if transposed else t


FORMS = {"gpt": Form("gpt2", gpt2_name, gpt2_config),
         "llama": Form("llama", llama.hf_name, llama.hf_config, llama.from_config, tuple(llama.FOLDERS))}
FORM_OF = {form.names: form for form in FORMS.values()}  # baton.json's "names" -> its form


def read_about(folder: str) -> dict:
    """An export's `baton.json` (`folder`: a local path or a URI), or what a `save_pretrained`
    folder of a model baton builds itself would say in one (`pretrained_about`)."""
    try:
        fs, path = located(folder)
        return json.loads(storage.read_retried(fs, f"{path}/{ABOUT}"))
    except (OSError, ValueError, StoreUnavailable) as e:
        about = pretrained_about(folder)
        if about is not None:
            return about
        why = redact(getattr(e, "strerror", None) or str(e))
        raise CheckpointError(f"{redact(folder)} is not a folder baton export wrote (its {ABOUT}: "
                              f"{type(e).__name__}: {why})") from None


def pretrained_about(folder: str) -> Optional[dict]:
    """A `save_pretrained` folder of a model that a built-in one computes (LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, whose safetensors the built-in llama reads by name:
    `Form.from_config`), as its baton.json would describe it: its files, the model section
    it is, in that form's names. None where `folder` is no such folder; CheckpointError where
    its model is one the built-in model does not compute the same way (biases on o_proj, a
    rotary embedding scaled other than Llama 3.1's, ...)."""
    from baton.models.hf import CONFIG, pretrained_files

    try:
        fs, path = located(folder)
        config = json.loads(storage.read_retried(fs, f"{path}/{CONFIG}"))
        form = next((f for f in FORMS.values() if config.get("model_type") in f.model_types), None)
        files = form and pretrained_files(folder)
    except (OSError, ValueError, StoreUnavailable):
        return None
    if not files:  # (weights in a pytorch_model.bin, a pickle: read only through transformers)
        return None
    try:
        made = form.from_config(config)  # its model section, and what it holds under another name
    except (KeyError, TypeError, ValueError) as e:
        why = str(e) if type(e) is ValueError else f"its {CONFIG} cannot be read ({type(e).__name__}: {e})"
        raise CheckpointError(f"{redact(folder)} is a save_pretrained folder of a "
                              f"{config.get('model_type')} model, and {why}") from None
    return {"files": files, "names": form.names, "pretrained": config.get("model_type"), **made}


def is_export(folder: str) -> bool:
    """`folder` holds an export's `baton.json` (False where it cannot be read)."""
    try:
        fs, path = located(folder)
        return storage.exists(fs, f"{path}/{ABOUT}")
    except (OSError, ValueError):
        return False


class Exported:
    """The parameters an export holds, by the model's own (baton's) names, each read from its
    file when asked for (safetensors reads one tensor without the rest): what `load_model`
    and `model.init_from` take them from, whichever names the export was written under."""

    def __init__(self, folder: str, fresh: Sequence[str] = (), grown: Sequence[str] = (),
                 about: Optional[dict] = None):
        """`fresh`: patterns (fnmatch) of the names a model keeps its own values of
        (`model.init_fresh`), which need not be here, or not at the model's shape. `grown`:
        those whose first dimension the model has grown (`model.init_grow`: tokens added at
        a vocabulary's end), whose rows here fill its first rows. `about`: what a folder
        baton did not write would say in its baton.json (checkpoint/frozen.py: an hf:
        model's save_pretrained folder)."""
        self.folder, self.about = folder, about or read_about(folder)
        self.fresh, self.grown = tuple(fresh), tuple(grown)
        self.fs, self.path = located(folder)
        self.files: dict[str, tensorfile.TensorFile] = {}
        try:
            self._index()
        except Exception as e:  # a baton.json or a file not as export writes them: one line
            self.close()
            raise CheckpointError(f"{redact(folder)} is not an export baton can read "
                                  f"({type(e).__name__}: {redact(str(e))[:200]})") from None

    def _index(self) -> None:
        from baton.models import _on_meta

        if "adapters" in self.about:
            raise ValueError("it holds low-rank adapters alone (baton export --adapters), not a "
                             "model: start from the model they adapt, with model.lora")
        self.spec = ModelSpec(**{**self.about["model"], "init_from": None, "init_fresh": [],
                                 "init_grow": []})
        kind = self.about.get("names", "baton")
        # a Hugging Face form's name (GPT-2's, Llama's) -> (baton's, transposed in the file)
        hf = ({theirs: (mine, transposed) for mine in _on_meta(self.spec).state_dict()
               for theirs, transposed in [FORM_OF[kind].name(mine, self.spec)]}
              if kind in FORM_OF else {})
        # baton's name -> (its file, the file's name for it, transposed in the file)
        self.where: dict[str, tuple[str, str, bool]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # baton's name -> its shape, as baton holds it
        for file in self.about["files"]:
            f = self.files[file] = tensorfile.TensorFile(self.fs, f"{self.path}/{file}")
            for stored in f.keys():
                # (a name the form does not know stays as it is: `problem` names it)
                mine, transposed = (hf.get(stored, (stored, False)) if kind in FORM_OF else
                                    (HF_NAMES + stored if kind == "transformers" else stored, False))
                shape = f.shape(stored)
                self.where[mine] = (file, stored, transposed)
                self.shapes[mine] = shape[::-1] if transposed else shape
        for mine, twin in self.about.get("tied", {}).items():  # (a save_pretrained folder's)
            if twin in self.where and mine not in self.where:
                self.where[mine], self.shapes[mine] = self.where[twin], self.shapes[twin]

    def get(self, name: str) -> torch.Tensor:
        file, stored, transposed = self.where[name]
        t = self.files[file].get(stored)
        return t.t().contiguous() if transposed else t

    def close(self) -> None:
        """Let go of the files (each is held open from the first read of its header)."""
        for f in self.files.values():
            f.close()
        self.files = {}

    def settings_problem(self, model: ModelSpec) -> Optional[str]:
        """Why a `save_pretrained` folder's model is not the job's where their shapes may agree
        (None: it is, or this is an export, whose job's settings are the user's to change):
        the settings that change a Llama's maths and no shape (`llama.MATHS`: its rotary
        embedding, RMSNorm's epsilon; and q, k and v's biases, a mixture's experts and its
        shared expert, named more plainly here than by the shape check), and a sliding
        window the job's sequence passes that it does not keep to (`window_problem`)."""
        if not self.about.get("pretrained"):
            return None
        named = {"experts": 0, "shared_expert": 0, **llama.MATHS}
        theirs = {**named, **self.about["model"]["options"]}  # (llama.from_config's)
        mine = {**named, **model.options}
        wrong = [k for k in named if theirs[k] != mine[k]]
        if wrong:
            def shown(side: dict) -> str:
                return ", ".join(f"{k} {_yaml(side[k])}" for k in wrong)
            return (f"its model has {shown(theirs)} (its config.json), and this job's "
                    f"model.options {'say' if len(wrong) > 1 else 'says'} {shown(mine)}: set "
                    + ", ".join(f"{k}: {_yaml(theirs[k])}" if theirs[k] is not None else f"no {k}"
                                for k in wrong))
        return self.window_problem(model)

    def window_problem(self, model: ModelSpec) -> Optional[str]:
        """Why the job's attention is not the folder's model's over the job's sequence: a
        window (`model.options.sliding_window`) passed by `model.seq_len` on one side and not
        the other, or another one; a window some of the model's layers keep to and others not."""
        theirs, mine, seq = self.about.get("window"), model.options.get("sliding_window"), model.seq_len
        if theirs is not None and seq > theirs and "window_layers" in self.about:
            return (f"its layers from {self.about['window_layers']} on attend within a sliding window "
                    f"of {theirs} positions and those before over the whole sequence (its "
                    f"config.json), and the built-in llama keeps to a window in every layer or "
                    f"in none: set model.seq_len to at most {theirs}, not {seq}")

        def slides(window: Optional[int]) -> Optional[int]:  # (a window the sequence passes)
            return window if window is not None and seq > window else None

        if slides(theirs) == slides(mine):
            return None
        said = (f"within a sliding window of {theirs} positions (its config.json's sliding_window)"
                if slides(theirs) else f"over the whole sequence")
        own = (f"model.options.sliding_window is {mine}" if slides(mine)
               else f"model attends over the whole sequence of {seq}")
        fix = (f"set model.options.sliding_window: {theirs} (or model.seq_len to at most {theirs})"
               if slides(theirs) else "leave model.options.sliding_window out")
        return f"its model attends {said}, and this job's {own}: {fix}"

    def problem(self, model: torch.nn.Module) -> Optional[str]:
        """Why `model` (on the meta device will do) cannot take these parameters: the first
        name or shape that differs. None: it can. Without `fresh` the export must hold every
        parameter of the model and no other; with it, every one it does not name (the export
        may hold more: the head the fresh one replaces)."""
        have = self.shapes
        want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        for key, patterns in (("init_fresh", self.fresh), ("init_grow", self.grown)):
            unmatched = next((p for p in patterns if not any(named(n, [p]) for n in want)), None)
            if unmatched is not None:
                return (f"model.{key}: {unmatched!r} names no parameter of this model (its "
                        f"names: {_some(want)})")
        grown = [n for n in want if named(n, self.grown)]
        both = next((n for n in grown if named(n, self.fresh)), None)
        if both is not None:
            return f"model.init_fresh and model.init_grow both name {both}: it is one or the other"
        for n in grown:
            if n not in have or have[n][1:] != want[n][1:] or have[n][0] > want[n][0]:
                return (f"model.init_grow: {self.folder} holds "
                        + (f"no {n}" if n not in have else f"{n} of shape {list(have[n])}")
                        + f", which cannot fill the first rows of this model's {list(want[n])}")
        want = {n: shape for n, shape in want.items() if not named(n, self.fresh) and n not in grown}
        missing = [n for n in want if n not in have]
        extra = [] if self.fresh else [n for n in have if n not in want and n not in grown]
        hint = "; model.init_fresh names those to keep the model's own values of"
        if missing or extra:
            return (f"{self.folder} holds {'no ' + missing[0] if missing else extra[0]!s}"
                    f"{' that this model has' if missing else ', which this model has not'} "
                    f"(it holds a {self.spec.name} of {self.spec.layers} layers, width "
                    f"{self.spec.width}){hint if missing else ''}")
        wrong = next((n for n in want if want[n] != have[n]), None)
        if wrong:
            return (f"{self.folder} holds {wrong} of shape {list(have[wrong])}, this model's is "
                    f"{list(want[wrong])}{hint}")
        if not want and not grown:
            return f"model.init_fresh names every parameter: nothing is taken from {self.folder}"
        return None

    def load_into(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Each of `module`'s parameters and buffers that the export holds and `fresh` does not
        name (`prefix`: the module's name in the whole model, with its dot), in place; a grown
        one's first rows."""
        with torch.no_grad():
            for name, t in module.state_dict(keep_vars=True).items():
                if prefix + name in self.where and not named(prefix + name, self.fresh):
                    theirs = self.get(prefix + name)
                    (t[:len(theirs)] if named(prefix + name, self.grown) else t).copy_(theirs)


def _yaml(value) -> str:
    """A setting's value as a job file would write it."""
    if value is None or isinstance(value, bool):
        return {None: "(none)", True: "true", False: "false"}[value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))  # (a rotary base of 1e6: 1000000)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _some(names, most: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def load_model(folder: str) -> torch.nn.Module:
    """The model an export holds, built from its `baton.json` and given its parameters (on
    the CPU, in eval mode): for inference, or to train further outside baton."""
    from baton.models import build_model

    exported = Exported(folder)
    model = build_model(exported.spec, 0)
    problem = exported.problem(model)
    if problem:
        raise CheckpointError(problem)
    exported.load_into(model)
    exported.close()
    return model.eval()
