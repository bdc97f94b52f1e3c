"""L4: continuations of a prompt through the pipeline engine (the recipe's end-of-training samples): greedy, and
sampled from the top k tokens at a temperature.

The pipeline needs fixed shapes (its stage boundary buffers are allocated once), so every step feeds one micro-batch
of the training shape [b, s]: the context left-aligned and padded with EOS, and reads the logits at the last context
position.  The loss stage (the last under 1F1B, rank 0 under DualPipeV) gathers its TP ranks' vocabulary blocks
(padding columns are -inf), picks the token, and the token is broadcast to every rank.  No KV cache: each new token
costs one forward of s positions, fine for a sample of a few dozen tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_megatron.config.schema import PIPELINE_SCHEDULES, PipelineSchedule
from ds_megatron.tensor_parallel import gather_last_dim
from ds_megatron.topology import ParallelTopology

STOPS = ("length", "eos", "blank")  # why a continuation ended: its token budget, EOS, a run of whitespace tokens


@dataclass(frozen=True)
class Decoder:
    """What every continuation shares: the engine, the layout, the training shape [micro_batch, seq_length] each
    forward is fed, the padding id and the real vocabulary size (logits beyond it are padding)."""

    engine: object
    topology: ParallelTopology
    seq_length: int
    micro_batch: int
    pad_id: int
    vocab_size: int
    schedule: PipelineSchedule = PIPELINE_SCHEDULES[0]  # the pipeline schedule: where the logits are, how many
    # micro-batches a forward takes

    def greedy(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        """Collective over all ranks: the generated token ids (the same list everywhere), always ``num_tokens``."""
        ids, _ = self._continue(prompt_ids, num_tokens, lambda full: int(full.argmax()))
        return ids

    def sampled(
        self,
        prompt_ids: list[int],
        num_tokens: int,
        top_k: int,
        temperature: float,
        seed: int,
        eos_id: int | None = None,
        is_blank: Callable[[int], bool] | None = None,
        max_blank: int = 4,
    ) -> tuple[list[int], str]:
        """Collective over all ranks: top-k / temperature sampling; returns the ids (the same everywhere, EOS
        included when drawn) and why it stopped (see STOPS): after ``num_tokens``, at ``eos_id``, or after
        ``max_blank`` tokens in a row that ``is_blank`` (whitespace only; a small model falls into runs of newlines)."""
        # A generator of its own, seeded from the run's seed: the sample is reproducible and the global RNG state
        # (and so whatever draws from it after the sample) is untouched.  Only the last stage draws (its TP ranks hold
        # the same gathered logits and the same generator); the broadcast of one rank's pick makes every rank take
        # the same token.  Vocabulary parallelism: the last position's logits are gathered over TP (one row of V
        # floats, nothing next to the forward of s positions that produced it), so top-k sees the whole vocabulary at
        # once; a vocab-parallel top-k (local top-k per rank, then a merge of the t x k candidates) would save that
        # gather and cost a second step.
        generator = torch.Generator().manual_seed(seed)
        blank_run = 0

        def stop(token: int) -> str | None:
            nonlocal blank_run
            if token == eos_id:
                return "eos"
            blank_run = blank_run + 1 if is_blank is not None and is_blank(token) else 0
            return "blank" if blank_run >= max_blank else None

        def pick(full: torch.Tensor) -> int:
            return top_k_pick(full, top_k, temperature, generator)

        return self._continue(prompt_ids, num_tokens, pick, stop)

    def _continue(
        self,
        prompt_ids: list[int],
        num_tokens: int,
        pick: Callable[[torch.Tensor], int],
        stop: Callable[[int], str | None] | None = None,
    ) -> tuple[list[int], str]:
        """The decoding loop: ``pick`` maps the full-vocabulary logits [V] of the last position to a token and
        ``stop`` may end the loop after a token; both run on the loss stage only, and their results travel with the
        broadcast, so every rank runs the same number of forwards (a rank that stopped early would leave the others
        hanging)."""
        ids = list(prompt_ids)[-self.seq_length :] or [self.pad_id]
        loss_rank = self.schedule.loss_rank(self.topology.pp)
        src = self.topology.ds_topology.get_rank(pipe=loss_rank, data=0, model=0)
        # DualPipeV runs no forward of fewer than 2p micro-batches: the same window fills each, the last one's logits
        # are read.
        count = max(1, self.schedule.micro_batches_per_rank * self.topology.pp)
        out: list[int] = []
        reason = 0
        for _ in range(num_tokens):
            window = ids[-self.seq_length :]
            n = len(window)
            x = torch.full((self.micro_batch, self.seq_length), self.pad_id, dtype=torch.long)
            x[:, :n] = torch.tensor(window)
            # eval_batch accumulates into total_loss without resetting it (only train_batch does); with
            # compute_loss=False the "loss" is the logits, so a scalar left by an earlier evaluation would not add up.
            self.engine.total_loss = None
            # A fused loss has the output layer hand its input to the loss; here the output layer's logits are read.
            with getattr(self.engine.module.loss_fn, "emitting_logits", contextlib.nullcontext)():
                _, logits = self.engine.eval_batch(
                    iter([(x, torch.zeros_like(x))] * count),
                    return_logits=True,
                    compute_loss=False,
                    reduce_output=None,
                    num_micro_batches=count,
                )
            message = torch.zeros(2, dtype=torch.long)  # [token, index in STOPS + 1 of why to stop, 0 to go on]
            if self.topology.pp_rank == loss_rank:
                local = logits[n - 1, 0].float().unsqueeze(0)  # [1, V_pad/t] at the last context position
                full = gather_last_dim(local, self.topology.tp_group)[0, : self.vocab_size]
                message[0] = int(pick(full))
                reason = stop(int(message[0])) if stop is not None else None
                message[1] = STOPS.index(reason) + 1 if reason else 0
            message = message.to(self.engine.device)
            dist.broadcast(message, src=src)
            token, reason = int(message[0]), int(message[1])
            ids.append(token)
            out.append(token)
            if reason:
                break
        self.engine.total_loss = None
        self.engine.module.train()
        return out, STOPS[reason - 1] if reason else "length"


def top_k_pick(logits: torch.Tensor, top_k: int, temperature: float, generator: torch.Generator) -> int:
    """Sample a token id from the ``top_k`` largest of ``logits`` [V], softened or sharpened by ``temperature``."""
    values, index = torch.topk(logits.float().cpu(), min(top_k, logits.numel()))
    probs = torch.softmax(values / temperature, dim=-1)
    return int(index[torch.multinomial(probs, 1, generator=generator)])
