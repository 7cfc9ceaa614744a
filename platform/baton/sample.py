"""`baton sample`: text from an exported language model (`baton export`), a token at a time,
as nanoGPT's sample.py does: the last `seq_len` tokens in, the next drawn from the last
position's logits (divided by the temperature, cut to the top k), on the CPU.

A model whose layers can run a position at a time on cached keys and values (a `decode`
method on each, as the built-in GPT's) runs each new token alone while the text fits its
`seq_len`; past it the window slides, every position's place in it changes (the positions
are absolute), and each token runs the whole window again, as for any other model.

The prompt is tokenised as the training corpus was (`baton data prepare` records its
tokenizer; the export copies it): bytes are read back as UTF-8 text; a tokenizer of your own
(`module:function`, which baton can run forwards only) gives token ids."""

from __future__ import annotations

from typing import Optional

import torch

from baton.errors import BatonError


def generate(model: torch.nn.Module, prompt: list[int], tokens: int, seq_len: int,
             temperature: float = 0.8, top_k: Optional[int] = 200, seed: int = 0,
             stop: Optional[int] = None, cache: bool = True) -> list[int]:
    """`tokens` more token ids after `prompt` (fewer where `stop`, the end-of-document token,
    is drawn: it is not returned). Deterministic for a seed. `cache=False`: every token runs
    the whole window (what the cache is measured against)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    out: list[int] = []
    layers = list(model) if isinstance(model, torch.nn.Sequential) else []
    cached = cache and layers and all(hasattr(layer, "decode") for layer in layers)
    caches: list[dict] = [{} for _ in layers]
    held = 0  # positions whose keys and values the caches hold
    with torch.no_grad():
        for _ in range(tokens):
            if cached and len(ids) <= seq_len:  # only the positions the caches lack
                x = torch.tensor([ids[held:]])
                for layer, c in zip(layers, caches):
                    x = layer.decode(x, c, held)
                held = len(ids)
                logits = x[0, -1].float()
            else:
                logits = model(torch.tensor([ids[-seq_len:]]))[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    logits[logits < torch.topk(logits, top_k).values[-1]] = -float("inf")
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if nxt == stop:
                break
            ids.append(nxt)
            out.append(nxt)
    return out


def sample(folder: str, prompt: str, tokens: int = 200, temperature: float = 0.8,
           top_k: Optional[int] = 200, seed: int = 0) -> str:
    """What the model in export `folder` writes after `prompt`: text for a byte-level
    corpus, token ids (as text) for a tokenizer of your own."""
    from baton.checkpoint.export import load_model, read_about
    from baton.data.text import load_tokenizer

    about = read_about(folder)
    if about.get("task", "language_model") != "language_model":
        raise BatonError(f"{folder} holds a {about['task']} model; baton sample writes text "
                         "with a language model")
    vocab = about.get("tokens")
    if not vocab:
        raise BatonError(f"{folder}: its job's corpus records no tokenizer (one written by "
                         "`baton data prepare` does), so the prompt cannot be tokenised")
    model = load_model(folder)
    seq_len = about["model"]["seq_len"]
    bytewise = vocab["tokenizer"] == "bytes"
    ids = (list(prompt.encode("utf-8")) if bytewise
           else [int(t) for t in load_tokenizer(vocab["tokenizer"])([prompt])[0]])
    if not ids:
        raise BatonError("--prompt: give at least one character to start from")
    out = generate(model, ids, tokens, seq_len, temperature, top_k, seed, vocab.get("eod_token"))
    if bytewise:
        # (a vocabulary wider than bytes can draw a token past 255, which no text held)
        return prompt + b"".join(bytes([t]) if t < 256 else "\ufffd".encode() for t in out).decode(
            "utf-8", errors="replace")
    return " ".join(map(str, ids + out))
