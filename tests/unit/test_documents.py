"""data.document_mask: documents packed into a row attend each to itself alone, their
positions counted from their own starts (models/documents.py), in the built-in models."""

from __future__ import annotations

import pytest
import torch

from baton.models import build_model
from baton.models.documents import attend_within, attending, documents
from baton.spec import ModelSpec

EOD = 0
MODELS = {
    "gpt": {"name": "gpt", "layers": 2, "width": 32, "heads": 2, "seq_len": 24, "vocab_size": 16},
    # grouped-query attention, Qwen3's normed heads and a mixture of experts: every path of
    # the llama's attention
    "llama": {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 24, "vocab_size": 16,
              "options": {"kv_heads": 2, "qk_norm": True}},
    "mixtral": {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 24, "vocab_size": 16,
                "options": {"kv_heads": 2, "hidden": 32, "experts": 4}},
}


def test_each_token_sees_its_own_document_up_to_itself():
    rows = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 3],
                         [EOD, 1, 2, 3, 4, EOD, EOD, 9]])
    docs = documents(rows, EOD)
    # the end-of-document token is its document's last; the next token starts one
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 0, 0]]
    doc = [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 3]]
    want = torch.tensor([[[doc[b][i] == doc[b][j] and j <= i for j in range(8)] for i in range(8)]
                         for b in range(2)])
    assert docs.mask.shape == (2, 1, 8, 8) and torch.equal(docs.mask[:, 0], want)


def test_a_sliding_window_keeps_within_the_documents_too():
    """model.options.sliding_window with data.document_mask: a query sees the keys of its own
    document at and before it, at most `window` of them (transformers' kv > q - window), from
    a training forward and from cached decoding (queries from `start` on) alike."""
    from baton.models.documents import attention

    rows = torch.tensor([[5, 6, EOD, 7, 8, 9, 4, EOD, 3, 2]])
    docs = documents(rows, EOD)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=gen) for _ in range(3))
    doc = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
    seen = torch.tensor([[doc[i] == doc[j] and i - 3 < j <= i for j in range(10)] for i in range(10)])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)
    assert torch.equal(attention(q, k, v, docs, 0, 0.0, window=3), want)
    band = torch.tensor([[i - 3 < j <= i for j in range(10)] for i in range(10)])
    alone = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    assert torch.equal(attention(q, k, v, None, 0, 0.0, window=3), alone)
    # the last 4 queries on the whole sequence's keys (a cache's): the rows of the whole's
    # (measured: 2.4e-7 apart at most over 20 seeds, on outputs of about 1: float32 rounding
    # of products of other shapes)
    torch.testing.assert_close(attention(q[:, :, 6:], k, v, None, 6, 0.0, window=3), alone[:, :, 6:],
                               rtol=0, atol=1e-6)
    assert torch.equal(attention(q, k, v, None, 0, 0.0, window=10),  # (a window not passed)
                       torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("window", [None, 5, 13])
def test_attention_a_block_at_a_time_is_the_whole_masks(monkeypatch, window):
    """One worker's attention under a document mask or a window the row passes runs a block
    at a time on a CPU (pieces of BLOCK positions; of 8 here, rows of 36: the last piece
    short), the blocks no query sees left out: its output and the gradients of q, k and v (4
    query heads on 2 key-value heads; rows of documents of 1 to 20 tokens, ends on pieces'
    edges and at a row's end) are the whole mask's through `scaled_dot_product_attention`."""
    from baton.models import documents as module

    monkeypatch.setattr(module, "BLOCK", 8)
    gen = torch.Generator().manual_seed(4)
    rows = torch.randint(1, 9, (3, 36), generator=gen)
    rows[0, [0, 7, 15, 35]] = EOD  # (a document of one token; ends on pieces' last positions)
    rows[1, [3, 27]] = EOD
    rows[2, 20] = EOD
    docs = documents(rows, EOD)
    at = torch.arange(36)
    band = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - (window or 36))
    q = torch.randn(3, 4, 36, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(3, 2, 36, 8, generator=gen, requires_grad=True) for _ in range(2))
    dy = torch.randn(3, 4, 36, 8, generator=gen)
    worst = {}
    for case, given in (("documents", docs), ("window alone", None)):
        if given is None and window is None:
            continue  # (causal alone: the whole kernel's own is_causal, no blocks)
        mask = band if given is None else docs.mask & band
        out = []
        for blocked in (True, False):
            for t in (q, k, v):
                t.grad = None
            y = (module.attention(q, k, v, given, 0, 0.0, gqa=True, window=window) if blocked
                 else torch.nn.functional.scaled_dot_product_attention(
                     q, k, v, attn_mask=mask, enable_gqa=True))
            y.backward(dy)
            out.append([y.detach()] + [t.grad for t in (q, k, v)])
        worst[case] = max(float((a - b).abs().max()) for a, b in zip(*out))
    assert len(docs.memo["blocks", 36, window, 1, 0, 8]) == 1  # (planned: the documents' blocks)
    print(worst)
    # measured: 2.6e-6 here, at most 1.9e-6 over 60 other layouts (20 seeds of random ends,
    # each window), on values of up to 7.5: the merge of blocks by log-sum-exp against one
    # softmax over the row (float32 rounding). A block with a document's edge computed
    # without its mask is 6.0 off there, left out 7.5
    assert max(worst.values()) < 1e-5, worst


def test_rows_of_short_documents_skip_the_blocks_between_them(monkeypatch):
    """Rows of documents of 8 tokens in pieces of 8: each piece is its own document's causal
    square, seen alone (no other block computed, no mask made); rows of one document each
    take the whole row's causal kernel (no blocks planned)."""
    from baton.models import documents as module
    from baton.parallel.ring import CAUSAL

    monkeypatch.setattr(module, "BLOCK", 8)
    rows = torch.randint(1, 9, (2, 32))
    rows[:, 7::8] = EOD
    docs = documents(rows, EOD)
    q, k, v = (torch.randn(2, 2, 32, 4) for _ in range(3))
    module.attention(q, k, v, docs, 0, 0.0)
    blocks = module.blocks_of(docs, 32, None, module.Alone(8))(0)
    assert [(b[0].start, b[1].start, b[2]) for b in blocks] == [(i, i, CAUSAL) for i in (0, 8, 16, 24)]
    assert "mask" not in docs.memo
    one = documents(torch.randint(1, 9, (2, 32)), EOD)
    module.attention(q, k, v, one, 0, 0.0)
    assert one.single and not one.memo  # (known from the tokens on the host)


def test_a_mask_given_whole_is_taken_as_it_is():
    """Documents with a mask of their own (a gathering worker's rows of the row's, with
    dropout) go to the kernel with that mask, on a CPU too: neither blocks nor causality
    alone (a mask that is not causal: each query sees the keys of its own parity), a window
    cut from it."""
    from baton.models.documents import Documents, attention

    at = torch.arange(12)
    mask = (at[:, None] % 2 == at[None, :] % 2)
    q, k, v = (torch.randn(2, 2, 12, 4) for _ in range(3))
    given = Documents(mask, at.expand(2, 12))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(attention(q, k, v, given, 0, 0.0), sdpa(q, k, v, attn_mask=mask))
    band = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - 4)  # (and a window)
    assert torch.equal(attention(q, k, v, given, 0, 0.0, window=4), sdpa(q, k, v, attn_mask=mask & band))


@pytest.mark.parametrize("name", MODELS)
def test_a_packed_document_computes_what_it_would_alone(name):
    """Each document of a packed row gives the logits it gives at the start of a row of its
    own; without the mask the second and third do not (they see the first)."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(**MODELS[name]), seed=3).eval()
    layers = attending(model)
    assert layers  # (the gpt's embedding and blocks, the llama's blocks)
    row = torch.randint(1, 16, (1, 24))
    row[0, 6] = row[0, 15] = EOD  # documents at 0..6, 7..15 and 16..23
    with torch.no_grad():
        attend_within(layers, documents(row, EOD))
        packed = model(row)
        attend_within(layers, None)
        alone = [model(row[:, a:b]) for a, b in ((0, 7), (7, 16), (16, 24))]
        plain = model(row)
    worst = max(float((packed[:, a:b] - one).abs().max())
                for (a, b), one in zip(((0, 7), (7, 16), (16, 24)), alone))
    # measured: 6.0e-8 (gpt), 4.5e-8 (llama), 3.0e-8 (mixtral) on logits of about 1: the same
    # products over other shapes (a 24 x 24 masked softmax against a 9 x 9 causal one)
    print(f"{name}: {worst:.2g}")
    assert worst < 1e-6, worst
    assert float((plain[:, 7:16] - alone[1]).abs().max()) > 1e-2  # the mask is what did it


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_rows_of_one_document_train_as_without_the_mask(name):
    """Rows with no end-of-document token: the mask is the causal one, and the gradients are
    those of the plain model (the masked kernel against is_causal's)."""
    torch.manual_seed(1)
    rows = torch.randint(1, 16, (3, 24))
    grads = []
    for masked in (False, True):
        model = build_model(ModelSpec(**MODELS[name]), seed=3)
        attend_within(attending(model), documents(rows, EOD) if masked else None)
        model(rows).logsumexp(-1).sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    worst = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])
    print(f"{name}: {worst:.2g}")
    # measured: 0.0 for both on this CPU (torch's CPU attention kernel takes the mask); the
    # bound is float32 rounding of sums over 72 rows, for kernels that differ (a GPU's)
    assert worst < 1e-5, worst
