"""The single-device MoE decoder of the Qwen3-MoE, Mixtral and Qwen2-MoE families.  Torch only.

Parameter names are exactly transformers 5's ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` /
``Qwen2MoeForCausalLM`` names (``model.layers.0.self_attn.q_norm.weight``, ``model.layers.1.mlp.gate.weight``,
``model.layers.1.mlp.experts.gate_up_proj``, ``model.layers.1.mlp.shared_expert.gate_proj.weight``), so the HF key
map is the identity.  Rotary positions, SwiGLU and the
attention core are Llama's (``model/llama/model.py``, ``model/layers.py``); the routed MLP is
``model.moe_layer.SparseMoeBlock``.  Activations inside the stack are ``[s, b, h]``.

The model returns logits and, on request, the routing statistics of all its routed layers summed
(``moe_layer.RouterStats``); :func:`training_loss` adds ``router_aux_loss_coef`` times the load-balancing loss (and
``router_z_loss_coef`` times the z-loss) to the LM loss, as transformers' ``loss += router_aux_loss_coef * aux_loss``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ds_megatron.model.layers import (
    SINGLE_DEVICE,
    BlockHooks,
    Modeling,
    RMSNorm,
    Slices,
    TiedEmbedding,
    init_by_name,
    whole,
)
from ds_megatron.model.llama.model import LlamaAttention, LlamaMLP
from ds_megatron.model.moe_layer import RouterStats, SparseMoeBlock, load_balancing_loss, router_z_loss
from ds_megatron.model.qwen3_moe import Qwen3MoeConfig


def shared_expert(config: Qwen3MoeConfig) -> LlamaMLP | None:
    """A routed layer's shared expert (Qwen2-MoE): a dense SwiGLU of ``shared_expert_intermediate_size``; None for a
    config without one."""
    width = getattr(config, "shared_expert_intermediate_size", 0)
    return LlamaMLP(dataclasses.replace(config, intermediate_size=width)) if width else None


class MoeBlock(nn.Module):
    """Pre-norm decoder block; its MLP is routed (``SparseMoeBlock``) or dense (``LlamaMLP``) by
    ``config.is_sparse(layer)``.  ``forward`` returns the output and the layer's router statistics (None if dense)."""

    def __init__(self, config: Qwen3MoeConfig, hooks: BlockHooks = SINGLE_DEVICE, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)  # with Qwen3's q/k norms when config.qk_norm
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = config.is_sparse(layer)
        if self.sparse:
            self.mlp = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                capacity_factor=config.moe_capacity_factor,
                shared_expert=shared_expert(config),
            )
        else:
            self.mlp = LlamaMLP(config)  # reads hidden_size and the dense intermediate_size
        self.hooks = hooks

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RouterStats | None]:
        """x [s, b, h] -> (x + attn(norm(x)), then + mlp(norm(.)); the routed layer's statistics)."""
        hooks = self.hooks
        stats: list[RouterStats] = []

        def mlp(y: torch.Tensor) -> torch.Tensor:
            if not self.sparse:
                return self.mlp(y, hooks)
            out, layer_stats = self.mlp(y, hooks)
            stats.append(layer_stats)
            return out

        attn = lambda y: self.self_attn(y, hooks, doc_ids, positions)  # noqa: E731
        x = x + hooks.around_norm(self.input_layernorm, (x,), attn)
        x = x + hooks.around_norm(self.post_attention_layernorm, (x,), mlp)
        return x, (stats[0] if stats else None)


class MoeDecoder(nn.Module):
    """Causal LM with transformers' ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` parameter names."""

    def __init__(self, config: Qwen3MoeConfig, seed: int = 1234):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=TiedEmbedding(config.vocab_size, config.hidden_size),
                layers=nn.ModuleList(MoeBlock(config, layer=i) for i in range(config.num_layers)),
                norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
            )
        )
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_moe_module(self, config, seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        return_router_stats: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, RouterStats | None]:
        """input_ids [b, s] -> logits [b, s, V]; with ``return_router_stats`` also the routed layers' statistics
        summed (None when no layer is routed)."""
        m = self.model
        x = m.embed_tokens(input_ids.t())  # [s, b, h]
        total: RouterStats | None = None
        for block in m.layers:
            x, stats = block(x, doc_ids, positions)
            if stats is not None:
                total = stats if total is None else total + stats
        x = m.norm(x)
        logits = (m.embed_tokens.logits(x) if self.config.tie_word_embeddings else self.lm_head(x)).transpose(0, 1)
        return (logits, total) if return_router_stats else logits


def router_losses(stats: RouterStats | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of the summed statistics; zeros when no layer is routed."""
    if stats is None:
        zero = torch.zeros(())
        return zero, zero
    return load_balancing_loss(stats), router_z_loss(stats)


def training_loss(lm_loss: torch.Tensor, stats: RouterStats | None, config: Qwen3MoeConfig) -> torch.Tensor:
    """lm_loss + router_aux_loss_coef * aux (+ router_z_loss_coef * z): what the optimizer minimises.  The parts
    are logged apart (``router_losses``)."""
    aux, z = router_losses(stats)
    loss = lm_loss + config.router_aux_loss_coef * aux.to(lm_loss.device)
    if config.router_z_loss_coef:
        loss = loss + config.router_z_loss_coef * z.to(lm_loss.device)
    return loss


def init_moe_module(
    module: nn.Module, config: Qwen3MoeConfig, seed: int, prefix: str = "", slices: Slices | None = None
) -> None:
    """Every parameter by its full name: N(0, std) for the linears, the router, the experts and the shared expert
    and its gate, std / sqrt(2 L) for the residual projections (o_proj, down_proj, the experts' and the shared
    expert's down_proj), ones for the RMSNorm weights, zeros for the q/k/v biases (``slices``:
    the part of each full parameter the module holds, ``model.layers.Slices``; None: all)."""
    from ds_megatron.model import FAMILIES  # the record of this config's family (Qwen3-MoE or Mixtral)

    def std_of(name: str) -> float | None:
        if name.endswith(("norm.weight", ".bias")):  # ones for the norms, zeros for Qwen2's q/k/v biases
            return None
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return config.initializer_range / math.sqrt(2 * config.num_layers)
        return config.initializer_range

    init_by_name(module, prefix, seed, std_of, slices or whole(FAMILIES[config.family]))


MODELING = Modeling(MoeDecoder, MoeBlock, lambda c: RMSNorm(c.hidden_size, c.rms_norm_eps), init_moe_module)
