"""L4: greedy continuation through the pipeline engine (the recipe's end-of-training sample).

The pipeline needs fixed shapes (its stage boundary buffers are allocated once), so every step feeds one micro-batch
of the training shape [b, s]: the
context left-aligned and padded with EOS, and reads the logits at the last context position.  The last stage
gathers its TP ranks' vocabulary blocks (padding columns are -inf), takes the argmax, and the token is broadcast to
every rank.  No KV cache: each new token costs one forward of s positions, fine for a sample of a few dozen tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_megatron.tensor_parallel import gather_last_dim
from ds_megatron.topology import ParallelTopology


def greedy_continuation(
    engine,
    topology: ParallelTopology,
    prompt_ids: list[int],
    num_tokens: int,
    seq_length: int,
    micro_batch: int,
    pad_id: int,
    vocab_size: int,
) -> list[int]:
    """Collective over all ranks: returns the generated token ids (the same list everywhere)."""
    ids = list(prompt_ids)[-seq_length:] or [pad_id]
    src = topology.ds_topology.get_rank(pipe=topology.pp - 1, data=0, model=0)
    out: list[int] = []
    for _ in range(num_tokens):
        window = ids[-seq_length:]
        n = len(window)
        x = torch.full((micro_batch, seq_length), pad_id, dtype=torch.long)
        x[:, :n] = torch.tensor(window)
        # eval_batch accumulates into total_loss without resetting it (only train_batch does); with
        # compute_loss=False the "loss" is the logits, so a scalar left by an earlier evaluation would not add up.
        engine.total_loss = None
        _, logits = engine.eval_batch(
            iter([(x, torch.zeros_like(x))]),
            return_logits=True,
            compute_loss=False,
            reduce_output=None,
            num_micro_batches=1,
        )
        token = torch.zeros(1, dtype=torch.long)
        if topology.is_last_stage:
            local = logits[n - 1, 0].float().unsqueeze(0)  # [1, V_pad/t] at the last context position
            full = gather_last_dim(local, topology.tp_group)[0, :vocab_size]
            token[0] = int(full.argmax())
        token = token.to(engine.device)
        dist.broadcast(token, src=src)
        ids.append(int(token))
        out.append(int(token))
    engine.total_loss = None
    engine.module.train()
    return out
