"""Text in, tokens out: `baton data prepare text`.

Documents come from a text column of Parquet files or a field of JSON Lines files. Each input
file is one task of a Ray Data map stage on the cluster's CPUs: its documents are tokenised (the
built-in byte tokenizer, or a user's `module:function`), joined with an end-of-document token,
packed into rows of `seq_len + 1` tokens (stride `seq_len`: each token but the first of a file's
stream is a target once; the tail that fills no row is dropped) and written as one Parquet part.
Parts are written under a temporary folder that is renamed into place when every part is done:
a failure leaves nothing. Deterministic: input files are taken in path order and packed one by
one, so the same input gives the same rows, whatever the cluster.

A user tokenizer is `fn(texts: list[str]) -> list[list[int]]` (token ids per document).

With `--one-per-row`, each document starts a row of its own instead, the rest of the row
filled with the end-of-document token, which a loss mask beside the tokens leaves out (a
document longer than a row is cut to it): no document attends to another.

With a prompt column (`--prompt-column`: instruction tuning), each document is a prompt and
its response (`--column`): the prompt's tokens, the response's and the end of document, with
a loss mask beside the tokens (a `loss_mask` column: 0 on the prompt's tokens, 1 on the
response's and its end), which `data.loss_mask_column` names for the job: it trains on the
responses alone. A response that is empty is a document of its prompt with nothing to learn.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from baton.data.corpus import staged_corpus, windows
from baton.data.feed import as_data_error
from baton.errors import DataError

BYTE_EOD = 0  # the byte tokenizer's end of document: NUL, which text does not hold
ROW_GROUP_BYTES = 2**20  # of tokens: the unit the stream reads and its order permutes
ID_STRIDE = 1 << 32  # sample ids: part index * ID_STRIDE + row in the part


def byte_tokenize(texts: list[str]) -> list[np.ndarray]:
    """Each document's UTF-8 bytes (a tokenizer may return any sequences of ints)."""
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


def load_tokenizer(name: Optional[str]) -> Callable[[list[str]], list[list[int]]]:
    if name is None:
        return byte_tokenize
    module, _, fn = name.partition(":")
    if not module or not fn:
        raise DataError(f"--tokenizer {name!r}: give module:function")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise DataError(f"--tokenizer {name!r}: cannot import it ({e})") from None


def input_files(path: str) -> list[Path]:
    root = Path(path)
    if root.is_file():
        return [root]
    files = sorted(p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl", ".json"))
    if not files:
        raise DataError(f"--input {path!r}: no .parquet, .jsonl or .json files")
    return files


def read_texts(file: Path, column: str, flag: str = "--column") -> list[str]:
    """The documents of one file; one line naming the file for anything that is not text."""
    if file.stat().st_size == 0:
        raise DataError(f"{file}: the file is empty")
    try:
        table = (pq.read_table(file, columns=None) if file.suffix == ".parquet"
                 else pajson.read_json(file))
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{file}: not readable as {file.suffix[1:]} ({str(e).splitlines()[0]})") from None
    if column not in table.column_names:
        raise DataError(f"{file}: no column {column!r} ({flag}); columns: "
                        f"{', '.join(table.column_names) or 'none'}")
    col = table.column(column)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise DataError(f"{file}: column {column!r} holds {col.type}, not text")
    if col.null_count:
        raise DataError(f"{file}: column {column!r} has {col.null_count} null rows")
    return col.to_pylist()


def pack(docs: list[list[int]], seq_len: int, eod: Optional[int],
         prompts: Optional[list[list[int]]] = None,
         one_per_row: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Rows of seq_len + 1 tokens from the documents joined (each followed by `eod`), and with
    `prompts` (one before each document) the rows' loss masks: 1 on a document's tokens and
    its `eod`, 0 on its prompt's. `one_per_row`: each document (after its prompt) at the
    start of a row of its own instead, the rest of the row `eod`s its mask leaves out, a
    longer one cut to the row: masks for every row."""
    examples = []  # each document's tokens (its prompt's first) and their marks
    for i, doc in enumerate(docs):
        prompt = np.asarray(prompts[i] if prompts is not None else [], dtype=np.int64)
        doc = np.concatenate([np.asarray(doc, dtype=np.int64), [eod] if eod is not None else []])
        examples.append((np.concatenate([prompt, doc]).astype(np.int64),
                         np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(doc), np.uint8)]))
    width = seq_len + 1
    if one_per_row:
        rows = np.full((len(examples), width), eod or 0, dtype=np.int64)
        masks = np.zeros((len(examples), width), dtype=np.uint8)
        for r, (tokens, marks) in enumerate(examples):
            rows[r, :len(tokens[:width])], masks[r, :len(marks[:width])] = tokens[:width], marks[:width]
        return rows, masks
    stream = np.concatenate([t for t, _ in examples]) if examples else np.zeros(0, dtype=np.int64)
    if len(stream) <= seq_len:
        empty = np.zeros((0, width), dtype=np.int64)
        return empty, None if prompts is None else empty.astype(np.uint8)
    if prompts is None:
        return windows(stream, seq_len), None
    return windows(stream, seq_len), windows(np.concatenate([m for _, m in examples]), seq_len)


def _token_type(vocab: int) -> pa.DataType:
    return pa.uint8() if vocab <= 256 else pa.uint16() if vocab <= 65536 else pa.int32()


def prepare_part(index: int, file: str, out_dir: str, column: str, seq_len: int,
                 tokenizer: Optional[str], eod: int, prompt_column: Optional[str] = None,
                 one_per_row: bool = False) -> dict:
    """One input file -> part-{index}.parquet in `out_dir` (run as a Ray task)."""
    texts = read_texts(Path(file), column)
    tokenize = load_tokenizer(tokenizer)
    docs = tokenize(texts)
    if len(docs) != len(texts):
        raise DataError(f"--tokenizer {tokenizer}: gave {len(docs)} token lists for {len(texts)} texts")
    prompts = None
    if prompt_column is not None:
        asked = read_texts(Path(file), prompt_column, "--prompt-column")
        prompts = tokenize(asked)
        if len(prompts) != len(asked):
            raise DataError(f"--tokenizer {tokenizer}: gave {len(prompts)} token lists for "
                            f"{len(asked)} texts")
    rows, masks = pack(docs, seq_len, eod, prompts, one_per_row)
    stats = {"index": index, "documents": len(texts), "samples": len(rows),
             "tokens": int(sum(map(len, docs)) + sum(map(len, prompts or ()))), "max_token": eod}
    if one_per_row:  # (a document, its prompt and its end longer than a row: cut to it)
        stats["cut"] = sum(len(d) + len(prompts[i] if prompts else ()) + 1 > seq_len + 1
                           for i, d in enumerate(docs))
    if not len(rows):
        return stats  # too short for one row: no part (a part of no rows would be a unit of none)
    top = int(max(rows.max(initial=0), eod))
    if rows.size and rows.min() < 0:
        raise DataError(f"--tokenizer {tokenizer}: gave negative token ids for {file}")
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)).cast(_token_type(top + 1)),
                                               seq_len + 1)
    ids = pa.array(index * ID_STRIDE + np.arange(len(rows), dtype=np.int64))
    row_bytes = rows.shape[1] * tokens.type.value_type.byte_width
    columns = {"sample_id": ids, "tokens": tokens}
    if masks is not None:
        columns["loss_mask"] = pa.FixedSizeListArray.from_arrays(pa.array(masks.reshape(-1)), seq_len + 1)
    pq.write_table(pa.table(columns),
                   Path(out_dir) / f"part-{index:05d}.parquet",
                   row_group_size=max(1, ROW_GROUP_BYTES // row_bytes))
    return stats | {"max_token": top,
                    **({"targets": int(masks[:, 1:].sum())} if masks is not None else {})}


def prepare_text(input_path: str, out: str, seq_len: int, column: str = "text",
                 tokenizer: Optional[str] = None, eod: Optional[int] = None,
                 on_ray: bool = True, about: Optional[dict] = None,
                 prompt_column: Optional[str] = None, one_per_row: bool = False) -> dict:
    """Tokenise and pack every input file: on the connected Ray, one task per file on this
    node (`out` is a local folder); or, `on_ray=False`, one after the other in this process
    (the built-in corpus, prepared before Ray starts). Both write the same bytes. `about`
    is merged into the corpus description (`_corpus.json`, and what this returns).
    `prompt_column`: each document is that column's prompt and `column`'s response, and
    the rows get a loss mask (the module's docstring); `one_per_row`: a document (and its
    prompt) a row, padded (`pack`)."""
    if tokenizer is not None and eod is None:
        raise DataError("--eod-token: give the end-of-document id of your tokenizer")
    eod = BYTE_EOD if eod is None else eod
    load_tokenizer(tokenizer)  # fails here, in one line, rather than in every task
    files = input_files(input_path)
    with staged_corpus(Path(out)) as tmp:
        def part(index: int, file: str) -> dict:
            return prepare_part(index, file, str(tmp), column, seq_len, tokenizer, eod, prompt_column,
                                one_per_row)

        parts = _on_ray(files, part) if on_ray else [part(i, str(f)) for i, f in enumerate(files)]
        samples = sum(p["samples"] for p in parts)
        if samples == 0:
            raise DataError(f"--input {input_path!r}: the documents hold fewer than "
                            f"seq_len + 1 = {seq_len + 1} tokens: no sample to write")
        info = {"source": str(input_path), "files": len(files), "seq_len": seq_len,
                "documents": sum(p["documents"] for p in parts), "samples": samples,
                "tokens": sum(p["tokens"] for p in parts), "tokenizer": tokenizer or "bytes",
                "eod_token": eod, "vocab_size": max(p["max_token"] for p in parts) + 1,
                **({"loss_mask_column": "loss_mask", "prompt_column": prompt_column,
                    "targets": sum(p.get("targets", 0) for p in parts)}
                   if prompt_column or one_per_row else {}),
                **({"one_per_row": True, "cut": sum(p["cut"] for p in parts)} if one_per_row else {}),
                **(about or {})}
        (tmp / "_corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def tokenised_by(path: str) -> Optional[dict]:
    """How `prepare_text` tokenised the corpus at `path`, as its `_corpus.json` records: the
    tokenizer (`bytes` or a `module:function`) and the end-of-document token; None for a
    corpus written otherwise, or not readable here."""
    from baton import storage

    try:
        fs, root = storage.resolve(path)
        info = json.loads(storage.read_bytes(fs, f"{root}/_corpus.json"))
        return {"tokenizer": str(info["tokenizer"]), "eod_token": info.get("eod_token")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _on_ray(files: list[Path], part: Callable[[int, str], dict]) -> list[dict]:
    """`part` of every file as a Ray Data map stage, its tasks kept on this node: they write
    into a local folder, which a task on another node would not see."""
    import ray

    # Ray's default node label: what a hard NodeAffinitySchedulingStrategy did, without Ray
    # Data's deprecation warning for a remote argument it has no named parameter for
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    items = [{"index": i, "file": str(f)} for i, f in enumerate(files)]
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map(
        lambda row: part(row["index"], row["file"]), label_selector=here)
    try:
        return sorted(ds.take_all(), key=lambda p: p["index"])
    except Exception as e:  # raised in a task, wrapped by Ray Data with its traceback
        error = as_data_error(e)
        if error is e:
            raise
        raise error from None
