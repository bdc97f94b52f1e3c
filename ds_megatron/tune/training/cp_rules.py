"""The context-parallel rules the tuner mirrors, read from their one owner, ``ds_megatron.config.context_parallel``
(the run's loader refuses the same layouts with the same functions): the sequence length the load-balanced layout
can cut, the a2a's heads, attention dropout, and the ``cp_comm`` names.  Standard library only."""

from __future__ import annotations

from ds_megatron.config import ConfigError, ModelShape
from ds_megatron.config.context_parallel import (
    CP_COMMS,
    check_cp_attention_dropout,
    check_cp_heads,
    check_cp_seq_length,
)


def cp_comms() -> tuple[str, ...]:
    """The exchanges CP attention can use ("ring", "a2a")."""
    return tuple(CP_COMMS)


def refusal(model: ModelShape, tp: int, cp: int, cp_comm: str, sequence_parallel: bool) -> str | None:
    """Why the run would refuse (tp, cp, cp_comm, SP) for ``model`` (the rule's one-line problem and values), or
    None when it accepts it."""
    if cp == 1:
        return None
    try:  # both families apply the model's dropout to the attention probabilities
        check_cp_attention_dropout(cp, model.dropout)
        check_cp_seq_length(model.seq_length, cp, tp, sequence_parallel)
        if cp_comm == "a2a":
            check_cp_heads(model.num_heads, model.num_kv_heads, tp, cp)
    except ConfigError as err:
        return f"{err.problem} ({err.values})"
    return None
