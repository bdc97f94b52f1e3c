"""Packed documents without cross-document attention: document ids and positions from the token ids (unit tests),
the single-device ``CoreAttention`` with document ids (eager and sdpa, GQA), and the checks of context-parallel ring
and a2a with document ids at cp 1, 2 and 4 that tests/unit/test_cp_attention.py runs in its spawn (``CHECKS``).

The reference is each document run alone: plain causal attention of every document's own q, k, v, put back at
its place in the window; output and dq, dk, dv within 1e-5 in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from inprocess import TOLERANCE, Pairs
from torch import Tensor

from ds_megatron.config import ConfigError
from ds_megatron.config.loader import check_data_section, parse_section
from ds_megatron.config.schema import DataSection
from ds_megatron.context_parallel import attention as cp_comm
from ds_megatron.context_parallel.layout import slice_for_rank
from ds_megatron.data.document_mask import document_ids, document_layout, document_positions
from ds_megatron.model.layers import CoreAttention, blocked_by_document

EOS = 0
B, S, D = 2, 24, 8  # cp 4: chunks of 3 tokens, cp 2: chunks of 6
BF16_TOLERANCE = 2e-2  # as for unmasked cp attention (bf16 rounding of the inputs and the output)

# Document lengths per batch row (each row sums to S).  "crossing": documents that cross chunk and rank boundaries
# at cp 2 and 4 and differ between the two rows; "one": one document spanning the window (plain causal); "tiny":
# documents of 1 and 2 tokens, shorter than a chunk, so most chunk pairs share no document.
MIXES = {
    "crossing": ((5, 7, 1, 11), (2, 13, 9)),
    "one": ((S,), (S,)),
    "tiny": ((1, 2) * 8, (2, 1) * 8),
}


def window_tokens(lengths: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """[s] token ids: documents of ``lengths`` tokens, each ending with EOS (the packed layout)."""
    docs = [torch.cat([torch.randint(1, 50, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    return torch.cat(docs)


def mix_ids(mix: str) -> Tensor:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.stack([window_tokens(lengths, gen) for lengths in MIXES[mix]])
    return document_ids(tokens, EOS)


def segments(ids_row: Tensor) -> list[tuple[int, int]]:
    """[start, stop) of each document of one row of ids, read off the ids (independent of the library)."""
    bounds = [0] + [j for j in range(1, len(ids_row)) if ids_row[j] != ids_row[j - 1]] + [len(ids_row)]
    return list(zip(bounds, bounds[1:]))


def per_document(q: Tensor, k: Tensor, v: Tensor, gout: Tensor, ids: Tensor) -> tuple[Tensor, ...]:
    """Every document alone: causal attention over its own tokens only; output and dq, dk, dv of sum(out * gout)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rows = []
    for b in range(q.shape[0]):
        parts = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, lo:hi],
                k[b : b + 1, :, lo:hi],
                v[b : b + 1, :, lo:hi],
                is_causal=True,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip
            for lo, hi in segments(ids[b])
        ]
        rows.append(torch.cat(parts, 2))
    out = torch.cat(rows, 0)
    out.backward(gout)
    return out, q.grad, k.grad, v.grad


# ---- document ids and positions ----


def test_eos_ends_its_document():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 3, 4], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids(tokens, EOS)
    # EOS keeps the id of the tokens before it; the token after it starts the next document
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    layout = document_layout(tokens, EOS)  # restart by default
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert document_layout(tokens, EOS, "global").positions.tolist() == [list(range(8))] * 2
    assert document_positions(ids, "restart").dtype == ids.dtype == torch.int64
    with pytest.raises(ValueError, match="restart"):
        document_positions(ids, "local")


def test_layout_of_a_rank_is_the_slice_of_the_whole_window():
    """A CP rank's ids and positions depend on EOS tokens in chunks other ranks hold: computed on the whole window,
    then sliced, they equal the whole window's at the rank's global indices (the restart position of rank 1's
    first token at cp 2 counts from a document that began on rank 0)."""
    ids = mix_ids("crossing")
    pos = document_positions(ids)
    for b in range(B):
        for lo, hi in segments(ids[b]):
            assert pos[b, lo:hi].tolist() == list(range(hi - lo))
    assert pos[0, 6].item() == 1  # cp 2: chunk 1 starts at token 6, inside the document that began at 5
    sliced = slice_for_rank(pos, 1, 1, 2)
    assert sliced[0, 0].item() == 1


def test_no_row_is_ever_fully_masked():
    """Causal + document masking always leaves a token its own key: no row of a diagonal block is all masked
    (so no softmax over nothing), whatever the documents."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 3, (B, S), generator=gen)  # EOS one token in three
        ids = document_ids(tokens, EOS)
        blocked = blocked_by_document(ids, ids, causal=True)
        assert not blocked.all(-1).any()
        assert not blocked.diagonal(dim1=-2, dim2=-1).any()


def test_config_keys():
    data = parse_section({"data": {"document_mask": True, "document_positions": "global"}}).data
    assert (data.document_mask, data.document_positions) == (True, "global")
    assert (DataSection().document_mask, DataSection().document_positions) == (False, "restart")
    check_data_section(DataSection(document_positions="global"))
    check_data_section(data)  # accepted: the model and the pipeline pass the ids through
    with pytest.raises(ConfigError) as err:
        check_data_section(DataSection(document_positions="local"))
    assert str(err.value).startswith("error: ds_megatron.data.document_positions:") and "'local'" in str(err.value)
    with pytest.raises(ConfigError, match="document_mask"):
        parse_section({"data": {"document_mask": "yes"}})


# ---- the model: a packed window equals each document run alone ----


def tiny_model(family: str):
    from ds_megatron.model import build_model, model_config

    shape = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 61, "seq_length": S, "dropout": 0.0}
    shape["init_std"] = 0.3  # weights large enough that positions visibly change the logits
    if family == "llama":
        shape.update(family="llama", num_kv_heads=2, intermediate_size=48, rope_theta=10000.0)
    from ds_megatron.config import resolve

    run = resolve({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "ds_megatron": {"model": shape}}, 1)
    cfg = model_config(run.model)
    return build_model(cfg, seed=7)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_window_loss_is_each_document_run_alone(family: str):
    """Restart positions and document masking make a packed window exactly the documents run alone: the packed
    model's per-token losses (labels: the window shifted, the EOS of a document predicting the next one's first
    token) equal those of every document run as its own sequence from position 0, in fp32 within 1e-5; and without
    the mask they differ.  GPT-2's learned positions also differ with global positions; rotary attention depends on
    position differences only, so inside a masked document global positions give Llama the same losses."""
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    window = torch.stack([torch.cat([window_tokens(lengths, gen), torch.randint(1, 50, (1,), generator=gen)])
                          for lengths in MIXES["crossing"]])  # fmt: skip
    inputs, labels = window[:, :-1], window[:, 1:]
    layout = document_layout(inputs, EOS, "restart")

    def token_losses(logits):
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # [b, s]

    with torch.no_grad():
        packed = token_losses(model(inputs, layout.doc_ids, layout.positions))
        alone = torch.zeros_like(packed)
        for b in range(B):
            for lo, hi in segments(layout.doc_ids[b]):
                logits = model(inputs[b : b + 1, lo:hi])  # the document alone: plain causal, positions 0..
                alone[b, lo:hi] = F.cross_entropy(logits[0], labels[b, lo:hi], reduction="none")
        plain = token_losses(model(inputs))
        global_positions = document_layout(inputs, EOS, "global").positions
        globally = token_losses(model(inputs, layout.doc_ids, global_positions))
    torch.testing.assert_close(packed, alone, rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(packed.mean(), alone.mean(), rtol=TOLERANCE, atol=TOLERANCE)
    assert (plain - alone).abs().max() > 1e-3
    if family == "gpt2":
        assert (globally - alone).abs().max() > 1e-3
    else:
        torch.testing.assert_close(globally, alone, rtol=1e-4, atol=1e-4)


def test_ring_scores_computed_per_rank():
    """The ring's work per rank with documents, as the load-balance table counts it: one document is plain causal
    ((2cp + 1) c^2 on every rank); documents no longer than a chunk leave only pairs that touch a boundary
    document; the count equals the chunk-pair count of the ids."""
    for cp in (2, 4):
        c = S // (2 * cp)
        assert cp_comm.ring_scores_computed(torch.zeros(1, S, dtype=torch.long), cp) == [(2 * cp + 1) * c * c] * cp
        for mix in ("crossing", "tiny"):
            ids = mix_ids(mix)
            want = [expected_pairs(ids, [r, 2 * cp - 1 - r], 2 * cp) * c * c for r in range(cp)]
            assert cp_comm.ring_scores_computed(ids, cp) == want
    # separate documents of exactly one chunk each: only the diagonal pairs are computed
    ids = torch.arange(8).repeat_interleave(3).unsqueeze(0)  # cp 4, c 3
    assert cp_comm.ring_scores_computed(ids, 4) == [2 * 9] * 4


# ---- single device: CoreAttention ----


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("n, n_kv", [(4, 4), (4, 2)])
def test_core_attention_keeps_documents_apart(kernel: str, n: int, n_kv: int):
    core = CoreAttention(SimpleNamespace(attention=kernel, head_dim=D, attn_pdrop=0.0))
    for mix in MIXES:
        torch.manual_seed(0)
        q, gout = torch.randn(B, n, S, D), torch.randn(B, n, S, D)
        k, v = torch.randn(B, n_kv, S, D), torch.randn(B, n_kv, S, D)
        ids = mix_ids(mix)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = core(*leaves, doc_ids=ids)
        out.backward(gout)
        expected = per_document(q, k, v, gout, ids)
        for what, got, want in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in leaves], expected):
            torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE, msg=f"{mix} {what}")
    # one document spanning the window is plain causal attention
    plain = core(q, k, v)
    torch.testing.assert_close(core(q, k, v, doc_ids=torch.zeros(B, S, dtype=torch.long)), plain)


# ---- context parallel: ring and a2a ----


def check_parity(c: Any, comm: str, kernel: str, n: int, n_kv: int, mix: str) -> Pairs:
    q, gout = torch.randn(B, n, S, D), torch.randn(B, n, S, D)
    k, v = torch.randn(B, n_kv, S, D), torch.randn(B, n_kv, S, D)
    ids = mix_ids(mix)
    out_ref, dq_ref, dk_ref, dv_ref = per_document(q, k, v, gout, ids)
    local = [slice_for_rank(t, 2, c.rank, c.cp).clone().requires_grad_() for t in (q, k, v)]
    local_ids = slice_for_rank(ids, 1, c.rank, c.cp)
    out = cp_comm.cp_attention(comm, *local, c.group, kernel, 1 / math.sqrt(D), doc_ids=local_ids)
    out.backward(slice_for_rank(gout, 2, c.rank, c.cp))
    pairs: Pairs = [
        ("output", out, slice_for_rank(out_ref, 2, c.rank, c.cp)),
        ("dq", local[0].grad, slice_for_rank(dq_ref, 2, c.rank, c.cp)),
        ("dk", local[1].grad, slice_for_rank(dk_ref, 2, c.rank, c.cp)),
        ("dv", local[2].grad, slice_for_rank(dv_ref, 2, c.rank, c.cp)),
        ("every row finite", torch.tensor(bool(out.isfinite().all())), torch.tensor(True)),
    ]
    if mix == "one":  # one document spanning the window: the same as no document ids
        plain = cp_comm.cp_attention(comm, *(t.detach() for t in local), c.group, kernel, 1 / math.sqrt(D))
        pairs.append(("one document = plain causal", out, plain))
    return pairs


def expected_pairs(ids: Tensor, query_chunks: list[int], num_chunks: int) -> int:
    """Chunk pairs (a, b <= a) with a in ``query_chunks`` that share a document in some batch row, counted from the
    ids chunk by chunk (independent of the library's pair rule)."""
    chunks = ids.chunk(num_chunks, 1)
    count = 0
    for a in query_chunks:
        for b in range(a + 1):
            share = any(set(chunks[a][r].tolist()) & set(chunks[b][r].tolist()) for r in range(ids.shape[0]))
            count += a == b or share
    return count


def check_skipped_pairs(c: Any, comm: str, mix: str) -> Pairs:
    """The chunk pairs computed forward and backward: only those that share a document (a pair sharing none is
    never computed), counted by replacing the kernels with counting wrappers."""
    ids = mix_ids(mix)
    calls = {"forward": 0, "backward": 0}
    real_forward, real_backward = cp_comm.block_forward, cp_comm.block_backward

    def forward(*args: Any) -> Any:
        calls["forward"] += 1
        return real_forward(*args)

    def backward(*args: Any) -> Any:
        calls["backward"] += 1
        return real_backward(*args)

    q, k, v = (slice_for_rank(torch.randn(B, 4, S, D), 2, c.rank, c.cp).requires_grad_() for _ in range(3))
    cp_comm.block_forward, cp_comm.block_backward = forward, backward
    try:
        out = cp_comm.cp_attention(comm, q, k, v, c.group, "sdpa", 1.0, doc_ids=slice_for_rank(ids, 1, c.rank, c.cp))
        out.sum().backward()
    finally:
        cp_comm.block_forward, cp_comm.block_backward = real_forward, real_backward
    if comm == "ring" and c.cp > 1:  # this rank's two chunks against every earlier or same chunk
        want = expected_pairs(ids, [c.rank, 2 * c.cp - 1 - c.rank], 2 * c.cp)
    else:  # a2a (and cp 1): every rank's head group over the whole sequence, in 2cp chunks
        num_chunks = 2 * c.cp
        want = expected_pairs(ids, list(range(num_chunks)), num_chunks)
    total = 2 * c.cp + 1 if comm == "ring" and c.cp > 1 else num_chunks * (num_chunks + 1) // 2
    result: Pairs = [
        ("pairs computed forward", torch.tensor(calls["forward"]), torch.tensor(want)),
        ("pairs computed backward", torch.tensor(calls["backward"]), torch.tensor(want)),
    ]
    if mix == "tiny":  # documents shorter than a chunk: some pairs must have been skipped
        result.append(("some pairs skipped", torch.tensor(want < total), torch.tensor(True)))
    if mix == "one":
        result.append(("nothing skipped for one document", torch.tensor(want), torch.tensor(total)))
    return result


def check_bf16_forward(c: Any, comm: str) -> Pairs:
    q, k, v = (torch.randn(B, 4, S, D).bfloat16() for _ in range(3))
    ids = mix_ids("crossing")
    out_ref = per_document(q.float(), k.float(), v.float(), torch.zeros(B, 4, S, D), ids)[0]
    local = [slice_for_rank(t, 2, c.rank, c.cp) for t in (q, k, v)]
    out = cp_comm.cp_attention(
        comm, *local, c.group, "sdpa", 1 / math.sqrt(D), doc_ids=slice_for_rank(ids, 1, c.rank, c.cp)
    )
    return [
        ("bf16 dtype kept", torch.tensor(out.dtype == torch.bfloat16), torch.tensor(True)),
        ("bf16 output", out.float(), slice_for_rank(out_ref, 2, c.rank, c.cp), BF16_TOLERANCE),
    ]


# Run by tests/unit/test_cp_attention.py in its spawn (cp 1 in the test process, cp 2 and 4 in one spawn of 4 gloo
# processes, one test each), with its Ctx (group, rank, cp): one spawn serves both files.
CHECKS: dict[str, Callable[[Any], Pairs]] = {}
for _comm in ("ring", "a2a"):
    for _kernel in ("eager", "sdpa"):
        for _n, _n_kv in ((4, 4), (8, 4)):  # (8, 4): grouped-query attention, KV heads divisible by cp 4
            CHECKS[f"{_comm}-{_kernel}-h{_n}-kv{_n_kv}-crossing"] = partial(
                check_parity, comm=_comm, kernel=_kernel, n=_n, n_kv=_n_kv, mix="crossing"
            )
    for _mix in ("one", "tiny"):  # both kernel names run the same masked block: one suffices here
        CHECKS[f"{_comm}-sdpa-h8-kv4-{_mix}"] = partial(check_parity, comm=_comm, kernel="sdpa", n=8, n_kv=4, mix=_mix)
    for _mix in MIXES:
        CHECKS[f"{_comm}-pairs-{_mix}"] = partial(check_skipped_pairs, comm=_comm, mix=_mix)
    CHECKS[f"{_comm}-bf16"] = partial(check_bf16_forward, comm=_comm)
CHECKS["ring-sdpa-h8-kv2-crossing"] = partial(check_parity, comm="ring", kernel="sdpa", n=8, n_kv=2, mix="crossing")


# ---- the data path: where the EOS id comes from, what the stream yields ----


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    """A small prepared directory (the one tests/unit/test_data_training.py trains from)."""
    from test_data_prepare import make_tokenizer, run_prepare, write_corpus

    tmp = tmp_path_factory.mktemp("prepared")
    run_prepare(write_corpus(tmp / "corpus"), make_tokenizer(tmp / "tok"), tmp / "out", progress=False)
    return tmp / "out"


def test_training_data_marks_documents_with_the_tokenizers_eos(tmp_path, prepared_dir):
    """With ``data.document_mask`` the run's data carries the EOS id its shards end documents with (the prepared
    manifest's, which is the tokenizer's) and the positions choice, and the micro-batch stream yields (input_ids,
    doc_ids, positions): each CP rank's slice of the whole window's layout.  Off, nothing changes: a tensor."""
    from test_data_training import run_config

    from ds_megatron.context_parallel.layout import unslice
    from ds_megatron.data import MicroBatchStream, open_prepared
    from ds_megatron.data import prepare as run_data

    prepared = str(prepared_dir)
    assert run_data.prepare_data(run_config(tmp_path, path=prepared), 0).documents is None
    run = run_config(tmp_path, seq=48, path=prepared, document_mask=True, document_positions="global")
    data = run_data.prepare_data(run, 0)
    eos = open_prepared(prepared).manifest["eos_id"]
    assert data.documents == (eos, "global") and eos == data.tokenizer.eos_token_id
    plain = MicroBatchStream(data.train, 2, 1, 0, 1)
    step = next(k for k, (ids, _) in enumerate(plain) if (ids == eos).any())  # a batch with a document boundary
    plain = next(MicroBatchStream(data.train, 2, 1, 0, 1, step))
    assert torch.is_tensor(plain[0])  # the default boundary: the ids alone
    docs = data.documents._replace(positions="restart")
    (ids, doc_ids, positions), labels = next(MicroBatchStream(data.train, 2, 1, 0, 1, step, documents=docs))
    assert torch.equal(ids, plain[0]) and torch.equal(labels, plain[1])
    layout = document_layout(ids, eos, "restart")
    assert torch.equal(doc_ids, layout.doc_ids) and torch.equal(positions, layout.positions)
    assert doc_ids.max() > 0
    pieces = [next(MicroBatchStream(data.train, 2, 1, 0, 1, step, r, 2, docs))[0] for r in range(2)]
    for k in range(3):
        assert torch.equal(unslice([p[k] for p in pieces], 1), (ids, doc_ids, positions)[k])
        assert pieces[0][k].dtype == torch.int64 and pieces[0][k].shape == (2, 24)
