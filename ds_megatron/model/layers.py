"""Layers the families share, and ``BlockHooks``: what TP, SP and recompute change inside a block, one object the
block is built with (defaults: single-device; ``parallelize.block_hooks`` builds the parallel ones).  Every other
change is a module swap of the plan (linears, embeddings, norms, dropouts).  Torch only, no torch.distributed."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ds_megatron.model.family import EXPERTS
from ds_megatron.model.kernels import EAGER, Kernels

# Runs a module's several linear layers on one input (q|k|v, gate|up).
Projection = Callable[[torch.Tensor, tuple[nn.Module, ...]], tuple[torch.Tensor, ...]]


class ScaledCausalSoftmax(torch.autograd.Function):
    """softmax(scores with the future masked) along the last dim, stored in the scores' dtype.

    ``F.softmax(x, dtype=float32).to(bf16)`` would keep the fp32 result for backward (4 bytes per score instead of 2:
    +25% of a block's activations at s 512, h 256, a 8) and ``masked_fill`` would keep the [s, s] mask.  Here only
    the output is saved, in the scores' dtype; backward recomputes nothing: dx = y * (dy - sum(dy * y)), which is
    zero at masked positions because y is zero there.  torch's softmax kernels accumulate bf16/fp16 inputs in fp32
    internally, so the scores are never converted as a whole (converting the s x s tensors to fp32 and back would
    be five more passes per layer over them)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        """scores [..., s, s] (already scaled); future [s, s] (or [b, 1, s, s] with document masking) bool, True
        where a token must not attend."""
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype), None


def compose(fn: Callable, inputs: tuple[torch.Tensor, ...], consumer: Callable) -> torch.Tensor:
    """``consumer(fn(*inputs))``: the single-device ``BlockHooks.around_norm`` and ``around_act``."""
    return consumer(fn(*inputs))


def project_each(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """Each linear applied to ``x``: the single-device ``BlockHooks.project``."""
    return tuple(linear(x) for linear in linears)


def contiguous_positions(seq_len: int) -> tuple[tuple[int, int], ...]:
    """Positions 0..s-1 as one [start, stop) range: the single-device ``BlockHooks.positions``."""
    return ((0, seq_len),)


def positions_tensor(ranges: tuple[tuple[int, int], ...], device: torch.device | None = None) -> torch.Tensor:
    """[s] int64: the positions of ``ranges`` ([start, stop) pairs) in order."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


class TensorCache:
    """Values derived from a tensor, kept while that tensor object lives unmodified, so what every block of a stage
    derives from the same micro-batch input is made once per micro-batch: packed documents' ids and positions reach
    each block as one object (the pipeline passes its boundary tuple on; recompute keeps integer inputs as they
    are).  Keyed by identity, weakly (an entry goes with its tensor), and checked against the tensor's version
    counter and the caller's ``extra`` key: an in-place write or a new tensor (the next micro-batch, a stage's
    received boundary) makes the value again."""

    def __init__(self) -> None:
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def get(self, key: torch.Tensor, make: Callable[[], Any], *extra: Any) -> Any:
        tag = (key._version, *extra)
        entry = self._entries.get(key)
        if entry is None or entry[0] != tag:
            entry = (tag, make())
            self._entries[key] = entry
        return entry[1]


def run_core(
    core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``core(q, k, v, doc_ids)`` in the default RNG state: the single-device ``BlockHooks.core_attention``."""
    return core(q, k, v, doc_ids)


class Modeling(NamedTuple):
    """A family's torch side (its ``model.py`` defines ``MODELING``; ``Family.modeling`` names that module)."""

    model: type  # the single-device model: Model(config, seed)
    block: type  # one transformer block: Block(config, hooks=BlockHooks())
    final_norm: Callable[[Any], nn.Module]  # final_norm(config): the norm after the blocks
    # init(module, config, seed, prefix, slices=None): parameters initialised by full name (``slices``: which of the
    # full parameter's slices the module holds; None: all, the single-device model)
    init: Callable[..., None]


@dataclass(frozen=True)
class BlockHooks:
    """The four places a block's forward leaves to parallelism and recompute (defaults: the single-device model).

    around_norm(norm, (x,), consumer)  ``consumer(norm(x))``.  Selective recompute of ``layernorm``: the norm's
                                       output is not stored for the consumer's backward but recomputed from x
                                       (``recompute.discard_output``), which the norm keeps anyway.
    around_act(act, inputs, consumer)  ``consumer(act(*inputs))``, the MLP activation before its second linear;
                                       ``mlp_act`` recomputes the activation's output the same way.
    project(x, linears)                each linear applied to x (q|k|v, gate|up).  Under TP, one collective on the
                                       input for all of them (one all-gather of a sequence shard under SP).
    core_attention(core, q, k, v,      ``core(q, k, v, doc_ids)``.  Under TP in the tensor-parallel RNG state
                   doc_ids=None)       (heads are split, so their dropout masks must differ across TP ranks); with
                                       selective recompute of ``core_attn`` checkpointed, its s x s tensors
                                       recomputed with the same RNG states in backward (the ids an input with no
                                       gradient).  Under context parallelism, attention over the whole sequence
                                       across the CP group.  ``doc_ids`` [b, s] (packed documents): the document of
                                       each token q, k, v hold, the whole (cp-local) sequence even under SP, since
                                       the projections all-gather the sequence before attention.
    positions(s)                       the global positions of the s tokens the attention sees, as [start, stop)
                                       ranges (hashable, so rotary tables are cached per layout): ``((0, s),)``
                                       on one device; a CP rank's two chunks under context parallelism.
    """

    around_norm: Callable[..., torch.Tensor] = compose
    around_act: Callable[..., torch.Tensor] = compose
    project: Projection = project_each
    core_attention: Callable[..., torch.Tensor] = run_core
    positions: Callable[[int], tuple[tuple[int, int], ...]] = contiguous_positions


SINGLE_DEVICE = BlockHooks()  # every block's default


def blocked_by_document(q_doc: torch.Tensor, k_doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, sq, sk] bool, True where query row i must not attend key j: j belongs to another document
    (``q_doc`` [b, sq], ``k_doc`` [b, sk] per-token document ids) or, for a causal (square, diagonal) block, lies in
    i's future.  The one rule of document masking; every kernel (single device and context parallel) builds its mask
    here.  A token always sees itself, so on a diagonal block no row is fully masked."""
    blocked = (q_doc[:, :, None] != k_doc[:, None, :]).unsqueeze(1)
    if causal:
        sq, sk = q_doc.shape[1], k_doc.shape[1]
        blocked = blocked | torch.ones(sq, sk, dtype=torch.bool, device=q_doc.device).triu(1)
    return blocked


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + causal mask) -> dropout -> x V: the part selective recompute checkpoints.  The
    attention module calls it through ``BlockHooks.core_attention`` (which picks its RNG state)."""

    def __init__(self, config: Any):
        """``config``: a family's config (``attention``, ``head_dim``, ``attn_pdrop``)."""
        super().__init__()
        self.kernel = config.attention
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _future_mask(self, s: int, device: torch.device) -> torch.Tensor:
        """[s, s] bool, True above the diagonal (positions a token must not attend to); built once per length."""
        key = (s, device)
        if key not in self._masks:
            self._masks[key] = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        return self._masks[key]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [b, n_heads, s, d], k and v [b, n_kv, s, d] -> context [b, n_heads, s, d].

        ``doc_ids`` [b, s] (packed documents, ``data.document_mask``): a token attends only to earlier tokens of its
        own document (``blocked_by_document``); the [b, 1, s, s] mask is built here from the ids, per call.  sdpa
        then runs with that boolean mask instead of ``is_causal`` (torch picks a kernel that takes a mask).

        With fewer KV heads than query heads (grouped-query attention), query head i attends with KV head
        i // (n_heads / n_kv).  K and V are never expanded to n_heads: the eager path folds each KV head's group of
        query heads into the row dim ([b, n_kv, g s, d]), so the matmuls store K and V at KV size."""
        n, n_kv = q.shape[1], k.shape[1]
        blocked = None if doc_ids is None else blocked_by_document(doc_ids, doc_ids, causal=True)
        if self.kernel == "sdpa":
            p = self.attn_dropout.p if self.training else 0.0
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if blocked is None else ~blocked,
                dropout_p=p,
                is_causal=blocked is None,
                scale=self.scale,
                enable_gqa=n != n_kv,
            )
        b, _, s, d = q.shape
        q = q * self.scale  # scaling q is s/d cheaper than scaling the scores
        if n != n_kv:
            q = q.reshape(b, n_kv, (n // n_kv) * s, d)
        scores = torch.matmul(q, k.transpose(-1, -2)).view(b, n, s, s)
        probs = ScaledCausalSoftmax.apply(scores, self._future_mask(s, q.device) if blocked is None else blocked)
        probs = self.attn_dropout(probs)
        if n == n_kv:
            return torch.matmul(probs, v)
        return torch.matmul(probs.view(b, n_kv, -1, s), v).view(b, n, s, d)


class TiedEmbedding(nn.Embedding):
    """Token embedding that doubles as the output layer (GPT-2's tied ``lm_head``)."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, V]."""
        return F.linear(x, self.weight)


# Where a parameter's initial values come from, given its full name and the tensor to fill: (the dim its slices run
# along, the global indices of its slices along that dim, -1 for a padding slice left zero; None: all, 0..n-1).
# A stacked expert tensor [E, ...] gives a 2-D index instead, [experts held, slices held] (``expert_slices``): each
# expert's slices are drawn on their own, so that a rank holding some experts (expert parallelism) or some rows of
# every expert (tensor parallelism) draws only what it holds.
Slices = Callable[[str, torch.Tensor], tuple[int, torch.Tensor | None]]


def expert_slices(experts: torch.Tensor, slices: torch.Tensor, full: int) -> torch.Tensor:
    """The 2-D slice index of a stacked expert tensor: global expert ids [m] and global slice ids [n] along the
    split dim (-1: padding) of a dim holding ``full`` slices per expert -> [m, n] ids ``e * full + slice``."""
    ids = experts[:, None] * full + slices[None, :]
    return torch.where(slices[None, :] < 0, torch.full_like(ids, -1), ids)


def whole(family: Any) -> Slices:
    """The single-device model's slices: all of them, along the dim TP splits the parameter (``Family.split_dim``;
    0 for a replicated one), so that a shard's slices are the same slices; a stacked expert tensor's per expert."""

    def slices(name: str, param: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        dim = family.split_dim(name) or 0
        row = family.row(name)
        if row is not None and row.style == EXPERTS:
            n = param.shape[dim]
            return dim, expert_slices(torch.arange(param.shape[0]), torch.arange(n), n)
        return dim, None

    return slices


@torch.no_grad()
def seeded_normal_(
    param: torch.Tensor, name: str, std: float, seed: int, dim: int = 0, index: torch.Tensor | None = None
) -> None:
    """Fill ``param`` with N(0, std) slice by slice along ``dim`` (rows for 0, columns for 1): the slice at global
    index g is drawn from a generator seeded by (seed, the full name, g).  The values depend only on the name, the
    seed and the global index, never on which stage or rank builds the module, which is what makes a tp=2, pp=2
    model start from exactly the weights of the single-device one (for every model family); and a TP shard
    (``index``: the global indices of its slices, -1 for a padding slice, left zero) draws only its own slices
    instead of the whole tensor.  torch's CPU generator keeps 32 bits of a seed: the slices of one parameter get
    consecutive seeds, so they never share one.  Meta tensors (shapes only) are left alone."""
    if param.is_meta:
        return
    base = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32
    if index is not None and index.dim() == 2:  # a stacked expert tensor: expert i's slices index[i] (dim > 0)
        for expert, ids in zip(param, index, strict=True):
            values = torch.empty(expert.movedim(dim - 1, 0).shape, dtype=torch.float32)
            expert.copy_(_draw_slices(values, ids.tolist(), base, std).movedim(0, dim - 1))
        return
    values = torch.empty(param.movedim(dim, 0).shape, dtype=torch.float32)  # [slices, ...]
    ids = range(len(values)) if index is None else index.tolist()
    param.copy_(_draw_slices(values, ids, base, std).movedim(0, dim))


def _draw_slices(values: torch.Tensor, ids, base: int, std: float) -> torch.Tensor:
    """values[j] <- N(0, std) drawn with the seed base + ids[j]; zero where ids[j] < 0 (a padding slice)."""
    gen = torch.Generator(device="cpu")
    for j, g in enumerate(ids):
        if g < 0:
            values[j].zero_()
        else:
            gen.manual_seed((base + g) % 2**32)
            values[j].normal_(0.0, std, generator=gen)
    return values


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm (``kernels.rms_norm_forward``).  Saves x and the fp32 1/rms per token only; ``kernels``: eager or
    compiled bodies (``ds_megatron.model.kernels``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: Kernels = EAGER) -> torch.Tensor:
        y, rstd = kernels.rms_norm_forward(x, weight, eps)
        ctx.kernels = kernels
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = ctx.kernels.rms_norm_backward(grad, x, weight, rstd)
        return grad_x, grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: Kernels = EAGER) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps, kernels)


class RMSNorm(nn.Module):
    kernels: Kernels = EAGER  # ``kernels.use_kernels`` sets the compiled ones

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@torch.no_grad()
def init_by_name(
    module: nn.Module, prefix: str, seed: int, std_of: Callable[[str], float | None], slices: Slices
) -> None:
    """Initialise every parameter of ``module`` whose full name is ``prefix + local name``: N(0, ``std_of(name)``)
    by :func:`seeded_normal_` over the ``slices`` it holds, or where that is None ones for a weight (norms) and
    zeros for a bias."""
    for local_name, param in module.named_parameters():
        name = prefix + local_name
        std = std_of(name)
        if std is None:
            param.fill_(1.0 if name.endswith(".weight") else 0.0)
        else:
            seeded_normal_(param, name, std, seed, *slices(name, param))
