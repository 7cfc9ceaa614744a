"""Hugging Face transformers models by configuration: `model.name: hf:TYPE` (any model type
transformers knows: gpt2, llama, bert, ...) with `model.config` (that type's configuration
keys), built from the configuration with parameters drawn from the job's seed, no weights
downloaded (no hub is reachable from most clusters' nodes, and none from here). A causal
language model by default; `model.options: {head: sequence_classification}` builds the
type's sequence classifier (`config.num_labels` classes) for `task: classification` over
token-id inputs. `model.init_from`: a `save_pretrained` folder to take the weights from,
local or a URI (`s3://`, copied to a temporary folder first; `baton export` writes one for an
hf: model).

An optional extra: `pip install 'baton[hf]'`."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Optional

from torch import nn

from baton.models import HF_PREFIX as PREFIX

HEADS = ("causal_lm", "sequence_classification")
CONFIG = "config.json"  # a save_pretrained folder's configuration


class HFModel(nn.Module):
    """A transformers model as baton runs one: token ids (B, T) in, logits out ((B, T, vocab)
    for a language model, (B, classes) for a classifier)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids.long(), use_cache=False).logits


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("hf: models need transformers: pip install 'baton[hf]'") from None
    return transformers


def problem(spec) -> Optional[str]:
    """Why `spec` names no buildable Hugging Face model (None: it does)."""
    kind = spec.name[len(PREFIX):]
    try:
        transformers = _transformers()
    except ImportError as e:
        return str(e)
    known = transformers.CONFIG_MAPPING.keys()
    if kind not in known:
        near = [k for k in sorted(known) if k.startswith(kind[:3])][:5]
        return (f"transformers has no model type {kind!r}"
                + (f"; near: {', '.join(near)}" if near else ""))
    head = spec.options.get("head", "causal_lm")
    if set(spec.options) - {"head"} or head not in HEADS:
        return f"hf: models take one option, head: {' | '.join(HEADS)}"
    try:
        config = _config(spec)
    except Exception as e:
        return f"model.config is not a {kind} configuration: {type(e).__name__}: {str(e)[:200]}"
    most = getattr(config, "max_position_embeddings", None)
    if head == "causal_lm" and isinstance(most, int) and spec.seq_len > most:
        return (f"model.seq_len {spec.seq_len} is more than the {most} positions of this "
                f"configuration; raise it in model.config (max_position_embeddings, or the "
                f"type's own name for it) or lower model.seq_len")
    return None


def _config(spec):
    """The type's configuration: model.vocab_size, then model.config. Special token ids the
    job does not set are none (the type's defaults, GPT-2's 50256, lie outside a smaller
    vocabulary; baton trains on the token rows it is given and generates nothing)."""
    kind = spec.name[len(PREFIX):]
    unset = {k: None for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k not in spec.config}
    return _transformers().AutoConfig.for_model(kind, **{"vocab_size": spec.vocab_size, **unset,
                                                         **spec.config})


def build_hf(spec) -> nn.Module:
    transformers = _transformers()
    head = spec.options.get("head", "causal_lm")
    auto = (transformers.AutoModelForCausalLM if head == "causal_lm"
            else transformers.AutoModelForSequenceClassification)
    if spec.init_from:
        import torch

        if torch.empty(0).device.type == "meta":  # names and shapes (the job's checks): the
            # folder's configuration, without its weights (from_pretrained refuses meta)
            with local_copy(spec.init_from, only=CONFIG) as folder:
                config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
            return HFModel(auto.from_config(config))
        with local_copy(spec.init_from) as folder:
            return HFModel(auto.from_pretrained(folder, local_files_only=True))
    return HFModel(auto.from_config(_config(spec)))


@contextlib.contextmanager
def local_copy(folder: str, only: Optional[str] = None):
    """A local folder holding what `folder` holds (`only`: that one file of it): itself, or for
    a URI (`s3://...`) a copy in a temporary folder, removed afterwards (transformers'
    from_pretrained reads local files)."""
    from baton import storage

    if not storage.is_uri(folder):
        yield folder
        return
    import pyarrow.fs as pafs

    fs, path = storage.resolve(folder)
    with tempfile.TemporaryDirectory(prefix="baton-init-") as tmp:
        if only:
            with open(f"{tmp}/{only}", "wb") as f:
                f.write(storage.read_retried(fs, f"{path}/{only}"))
        else:
            pafs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield tmp


def pretrained_files(folder: str) -> Optional[list[str]]:
    """The safetensors files a `save_pretrained` folder holds its weights in: its index's
    (`model.safetensors.index.json`), or `model.safetensors`. None: neither is there (its
    weights are a `pytorch_model.bin`, a pickle, which baton reads only through transformers)."""
    import json

    from baton import storage
    from baton.checkpoint.export import INDEX, SINGLE, located

    fs, path = located(folder)
    if storage.exists(fs, f"{path}/{INDEX}"):
        return sorted(set(json.loads(storage.read_retried(fs, f"{path}/{INDEX}"))["weight_map"].values()))
    return [SINGLE] if storage.exists(fs, f"{path}/{SINGLE}") else None
