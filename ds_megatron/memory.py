"""L3: analytic activation memory (Korthikanti et al. 2022, sec. 4), for every model family.  Pure Python.

Per transformer layer, in bytes, for s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.  The
paper counts 2-byte activations and 1-byte dropout masks; ``act_bytes`` and ``mask_bytes`` generalise that so a
measurement in another dtype (fp32 on CPU: 4 and 4) can be compared term by term.  ``family`` picks the block's
terms (``Family.block_terms`` in ``ds_megatron/model/<family>/``; GPT's are the paper's sec. 4.1 table, eager
attention); the attention kernels and the recompute policies are shared by all.  Selective recompute drops the s^2
terms; full recompute keeps only the block input (h in activation bytes, split by SP).

With ``attention="sdpa"`` what is stored depends on the path torch takes, named by ``sdpa_path`` (the same for both
families): ``"fused"`` (the default: CUDA's flash and memory-efficient kernels, the CPU flash kernel at attention
dropout 0) stores no s^2 term but an fp32 log-sum-exp per score row, 4 a / (h t) in units of s*b*h bytes;
``"math"`` (the CPU with attention dropout, CUDA when no fused kernel fits) brings the s^2 terms back in
``math_act_bytes`` and ``math_mask_bytes``, with its own scaled Q, K, V (K and V repeated to all a heads).  The
derivation and measurements: docs/tuner.md, "Attention kernels in the activation formula".
Selective recompute takes ``modules``: ``core_attn`` (the default, the paper's selective recompute) drops the s^2
terms and is refused with sdpa (the config loader refuses it too: the fused kernels never store the s x s core);
``mlp_act`` drops the MLP activation's output (the second linear's input: 4h per token for GPT, F for Llama, split by
TP) and ``layernorm`` the two norm outputs (the first linears' inputs: 2h, split by SP), with any kernel.  Full
recompute keeps the block input whatever the kernel.

Context parallelism (``cp`` > 1, ``cp_comm`` "ring" or "a2a", ``context_parallel.attention``): each rank holds
``s / cp`` tokens (two load-balanced chunks), so every term above is taken at ``s / cp`` (``s / (cp t)`` under SP).
The attention core is then the cp_comm autograd function, whatever ``attention`` names: it saves q, k, v (the
family's Q, K, V terms, counted already: the ring keeps its inputs, the a2a its head-sharded copies of the whole
sequence at ``a / (t cp)`` heads, the same element count), the core's output [b, a/t, s/cp, d] and the fp32
log-sum-exp [b, a/t, s/cp] (4 a / h per token in units of h, split by TP).  The ring's output is the storage the
output projection saves as its [s, b, h] input (merged in that layout: counted once, among the family's terms); the
a2a's is its head-sharded core's [b, a/(t cp), s, d], a tensor of its own beside the projection's input (+1 h per
token, split by TP): :func:`cp_output_is_projection_input`.  Both backward passes recompute the
probabilities from q, k and lse, so no s x s term is stored with either kernel.  Selective recompute of core_attn
(eager) checkpoints the whole cp_comm call, exchange included: it keeps only q, k and v, dropping the log-sum-exp
and the a2a's own output (the ring's is still the projection's input), and runs the exchange again in backward.
What one layer's exchange holds only while it runs (double-buffered K/V, the dK/dV accumulators, the eager
kernel's score blocks) is :func:`cp_transient_bytes`.
The rotary cos/sin tables of a rotary family are one pair per process, shared by its blocks (at any cp):
:func:`rotary_table_bytes`, counted once per stage, not in the per-layer terms.
"""

from __future__ import annotations

from ds_megatron.config.context_parallel import check_cp_attention_dropout, check_cp_comm
from ds_megatron.config.rules import check_core_attn
from ds_megatron.config.schema import (
    ATTENTION_KERNELS,
    DEFAULT_SELECTIVE_MODULES,
    RECOMPUTE_MODULES,
    RECOMPUTE_POLICIES,
    PipelineSchedule,
)
from ds_megatron.config.shape import Vocabulary
from ds_megatron.model import DEFAULT_FAMILY, FAMILIES, family_named
from ds_megatron.model.family import BlockTerms, RoutedShape

MODES = RECOMPUTE_POLICIES  # "none", "selective", "full"
KERNELS = ATTENTION_KERNELS  # "eager", "sdpa"
SDPA_PATHS = ("fused", "math")
# The shared rules' errors name this module's arguments (the config loader's name the config file's keys).
FORMULA_ARGUMENTS = Vocabulary(prefix="", refs={"recompute_modules": "modules", "attention": "attention"})
LSE_BYTES = 4  # the fused sdpa kernels keep each score row's log-sum-exp in fp32, whatever the activation dtype


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    mask_bytes: int = 1,
    attention: str = "eager",
    sdpa_path: str = "fused",
    math_act_bytes: int = 4,
    math_mask_bytes: int = 4,
    *,
    family: str = DEFAULT_FAMILY,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    attention_dropout: float | None = None,
    modules: tuple[str, ...] = (),
    cp: int = 1,
    cp_comm: str = "ring",
    routed: RoutedShape | None = None,
    ep: int = 1,
    expert_tp: int = 1,
    dense_layer: bool = False,
) -> float:
    """Bytes of activations one transformer layer keeps for backward, per TP rank (and CP rank: ``cp`` > 1 takes
    every term at ``s / cp`` and the cp_comm core's log-sum-exp, and the a2a's output, in place of the s^2 terms).

    ``modules`` (selective recompute only; empty means ``("core_attn",)``): ``core_attn`` drops the s^2 terms,
    ``mlp_act`` the MLP activation's output (GELU's 4h, SwiGLU's F per token, split by TP), ``layernorm`` the two
    norm outputs (2h per token, split by SP): each is recomputed from what its function keeps anyway.

    ``attention`` "eager" is the paper's table; "sdpa" with ``sdpa_path`` "fused" drops the s^2 terms and adds
    the fp32 log-sum-exp, 4 a s b / t bytes; "math" is the reference path described in the module docstring.
    A family without GPT's defaults (Llama) needs ``num_kv_heads`` and ``intermediate_size``; ``attention_dropout``
    is Llama's only dropout (default 0; the GPT formula always counts dropout, the paper's setting).  A routed
    family (``qwen3_moe``, ``mixtral``, ``qwen2_moe``) needs ``routed`` (``RoutedShape``: head width, experts);
    its block adds the tensors the experts keep for all tokens on every TP rank (``BlockTerms.whole``) and a few
    bytes per block, and ``moe`` (selective) trades the experts' activations for the checkpoint's inputs.  At ``ep``
    > 1 (the expert-parallel layer: SP at tp > 1) each rank routes its own tokens (its sequence shard) through whole
    experts: the experts' tensors are kept for those tokens only (uniform routing: a rank receives as many pairs as
    it sends), with the dispatch's permutations (``BlockTerms.ep_whole``), and the grouped GEMM's offsets for its
    E / ep experts.  With ``expert_tp`` = t at ep > 1 (each expert's width split over TP) the tokens enter the experts
    as the dense MLP's (gathered over TP under SP): the experts' tensors and the permutations are kept for the s b
    tokens every TP rank runs, their F-wide intermediates at F / t.  ``moe`` at ep > 1 checkpoints the local
    experts on the dispatched rows (``expert_parallel.layer``): those rows stay (the grouped GEMM's input, counted
    among the experts' tensors), the experts' split activations (``BlockTerms.moe_split``) and the offsets go; the
    combine, the weighted sum and the dispatch's permutations sit outside the checkpoint and keep what they keep
    without it.  ``dense_layer``: a routed family's dense block (a layer of ``mlp_only_layers`` or off
    ``decoder_sparse_step``: a SwiGLU of ``intermediate_size``, which ``moe`` and ep leave alone)."""
    modules = _checked_modules(recompute, attention, sdpa_path, family, modules)
    if ep > 1 and routed is None:
        raise ValueError(f"ep > 1 needs a routed family, got family={family!r}")
    if expert_tp not in (1, t) or (expert_tp > 1 and ep == 1):
        raise ValueError(f"expert_tp is 1 or t ({t}) at ep > 1 (ep 1 splits every expert over TP), got {expert_tp}")
    if cp > 1:
        check_cp_comm(cp_comm)
        check_cp_attention_dropout(cp, attention_dropout or 0.0)
        s = s // cp  # this rank's two chunks (the layout rule makes s divisible by 2 cp)
    routed_kw = {} if routed is None else {"routed": routed, **({"dense": True} if dense_layer else {})}
    block_terms = FAMILIES[family].block_terms
    terms = block_terms(h, a, num_kv_heads, intermediate_size, attention_dropout, act_bytes, **routed_kw)
    sp = sequence_parallel and t > 1
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (t if sp else 1)
    local_moe = ep > 1 and "moe" in modules  # the local experts alone checkpointed (above)
    kept_modules = tuple(m for m in modules if m != "moe") if local_moe else modules
    replicated, split, whole, fixed = _kept_after_recompute(terms, kept_modules, sp, act_bytes, mask_bytes)
    if local_moe:
        split, fixed = split - terms.moe_split, fixed - terms.moe_fixed
    if "core_attn" not in modules and cp <= 1 and attention == "sdpa" and sdpa_path == "math":
        split += 3 * math_act_bytes - terms.qkv * act_bytes  # Q, K, V saved as the path's own (upcast, expanded) copies
    quadratic = _attention_core_per_token(
        terms, modules, s, a, h, cp, cp_comm, attention, sdpa_path,
        (act_bytes, mask_bytes), (math_act_bytes, math_mask_bytes),
    )  # fmt: skip
    routed_extra = sbh * whole + fixed  # 0 for a dense block
    if ep > 1:  # the grouped GEMM's offsets (``moe_fixed``) are its E / ep local experts' (none under ``moe``)
        offsets = 0.0 if local_moe else terms.moe_fixed * (1 - 1 / ep)
        # whole experts: this rank's own tokens (its sequence shard under SP); split over TP: all the TP group's
        routed_extra = sbh * (whole + terms.ep_whole) / (t if sp and expert_tp == 1 else 1) + fixed - offsets
    if sp:
        return sbh * (replicated + split + quadratic) / t + (routed_extra if routed is not None else 0)
    return sbh * (replicated + (split + quadratic) / t) + (routed_extra if routed is not None else 0)


def _checked_modules(
    recompute: str, attention: str, sdpa_path: str, family: str, modules: tuple[str, ...]
) -> tuple[str, ...]:
    """The modules selective recompute recomputes (the default list when none are named; none for another policy),
    after refusing an unknown policy, kernel, path, family or module, and the shared rules' refusals."""
    if recompute not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {recompute!r}")
    if attention not in KERNELS:
        raise ValueError(f"attention must be one of {KERNELS}, got {attention!r}")
    if sdpa_path not in SDPA_PATHS:
        raise ValueError(f"sdpa_path must be one of {SDPA_PATHS}, got {sdpa_path!r}")
    family_named(family)
    if modules and recompute != "selective":
        raise ValueError(f"modules apply to selective recompute only, got recompute={recompute!r}")
    modules = (tuple(modules) or DEFAULT_SELECTIVE_MODULES) if recompute == "selective" else ()
    if set(modules) - set(RECOMPUTE_MODULES):
        raise ValueError(f"modules must be among {RECOMPUTE_MODULES}, got {modules}")
    check_core_attn(attention, modules, FORMULA_ARGUMENTS)
    return modules


def _kept_after_recompute(
    terms: BlockTerms, modules: tuple[str, ...], sp: bool, act_bytes: int, mask_bytes: int
) -> tuple[float, float, float, float]:
    """The block's terms outside the attention core once selective recompute drops ``modules``' outputs: bytes per
    token and hidden unit replicated over TP, split by TP, kept whole on every TP rank (routed experts), and fixed
    bytes per block."""
    replicated = terms.replicated + terms.replicated_masks * mask_bytes
    split = terms.split
    whole, fixed = terms.whole, terms.fixed
    if "layernorm" in modules:
        replicated -= terms.norm_outputs * act_bytes  # the q/k/v (c_attn) input and the fc1 (gate/up) input
    if "moe" in modules:  # the experts' activations for the checkpoint's inputs
        split -= terms.moe_split
        whole += terms.moe_kept + (terms.moe_kept_sp if sp else 0.0) - terms.moe_whole
        fixed -= terms.moe_fixed
        if "layernorm" in modules and not sp:
            whole -= terms.moe_kept_norm
        if not sp:
            whole -= terms.moe_kept_counted
    if "mlp_act" in modules:
        split -= terms.mlp_act * act_bytes
    return replicated, split, whole, fixed


def _attention_core_per_token(
    terms: BlockTerms,
    modules: tuple[str, ...],
    s: int,
    a: int,
    h: int,
    cp: int,
    cp_comm: str,
    attention: str,
    sdpa_path: str,
    dtypes: tuple[int, int],
    math_dtypes: tuple[int, int],
) -> float:
    """What the attention core keeps, per token and hidden unit and split by TP like the paper's s^2 terms: nothing
    when core_attn is recomputed; the cp_comm core's output and log-sum-exp under CP; the fused sdpa's log-sum-exp;
    the math sdpa's or eager's softmax (and dropout) output and mask, ``a s / h`` per unit."""
    act_bytes, mask_bytes = dtypes
    math_act_bytes, math_mask_bytes = math_dtypes
    if "core_attn" in modules:
        return 0.0
    if cp > 1:  # the cp_comm core's fp32 log-sum-exp and output; its backward recomputes the probabilities
        return (0 if cp_output_is_projection_input(cp_comm) else act_bytes) + LSE_BYTES * a / h
    if attention == "sdpa" and sdpa_path == "fused":
        return LSE_BYTES * a / h  # the log-sum-exp in place of the s^2 terms; split by TP like them
    if attention == "sdpa":
        return (math_act_bytes + (math_act_bytes + math_mask_bytes if terms.attention_dropout else 0)) * a * s / h
    # eager: softmax output, and the dropout's output and mask (paper: 5 a s / h)
    return (act_bytes + (act_bytes + mask_bytes if terms.attention_dropout else 0)) * a * s / h


def cp_output_is_projection_input(cp_comm: str) -> bool:
    """Whether the output the cp_comm core saves for backward is the very storage the attention's output projection
    saves as its input: the ring merges its blocks into a buffer in the model's [s, b, n, d] layout and returns it
    (``cp_comm._RingAttention``); the a2a saves its head-sharded core's output [b, n/cp, s, d] and returns another
    tensor, the all-to-all's sequence-sharded result."""
    return cp_comm == "ring"


def cp_core_saved_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, cp: int = 2, *, num_kv_heads: int | None = None, act_bytes: int = 2
) -> float:
    """What the cp_comm autograd function of one layer saves for backward on one TP and CP rank (ring and a2a
    alike): q [b, a/t, s/cp, d], k and v at KV-head size, the output like q, all in activation bytes, and the fp32
    log-sum-exp [b, a/t, s/cp].  The a2a saves its head-sharded copies [b, a/(t cp), s, d]: the same counts.  (In a
    block the ring's output is also the projection's input: :func:`cp_output_is_projection_input`.)"""
    d, kv = h // a, a if num_kv_heads is None else num_kv_heads
    rows = b * (s // cp)
    return rows * d * (2 * a + 2 * kv) / t * act_bytes + rows * a / t * LSE_BYTES


def ring_dkv_hop_bytes(cp: int, act_bytes: int = 2, documents: bool = False) -> list[int]:
    """Bytes per element of the dK/dV accumulator [2, b, a_kv/t, s/cp, d] on each of the ring backward's cp hops
    (``cp_comm._dkv_message``): fp32 (fp64 for fp64 K/V) so the sum over cp ranks rounds once, except the first
    (one diagonal block's grads, nothing summed yet) and the last one home (its owner would only round it), which
    travel in the K/V's own dtype, bit for bit the same; at cp 2 those are the only two hops.  With packed
    documents (``documents``) the first hop carries an fp32 sum too (the diagonal's chunk pairs add into the same
    key rows).  The one owner of the hop dtypes: the memory of the messages and the time model's hop bytes."""
    acc = max(act_bytes, 4)
    return [act_bytes if (hop == 0 and not documents) or hop == cp - 1 else acc for hop in range(cp)]


def _ring_backward_peak(q: float, e: float, cp: int, act: int, documents: bool) -> float:
    """The most bytes of the ring backward's own buffers alive at once (``cp_comm._RingAttention.backward``), q
    and e the elements of q and of the K/V stack on one rank; the saved tensors and the block kernel's internals
    are not counted (the eager score blocks are, apart).  The points where they peak, step by step (step t holds
    the K/V of rank (rank - t) mod cp; its block kernel's results are dq, dk, dv of one block, or with documents
    of one chunk pair at a time, the dk, dv kept until the accumulator arrives):
      the kernel's results, beside the fp32 dq, the K/V received (none at step 0: the rank's own are saved) and
      the next one arriving (none at the last step), the accumulator this rank sent and the one arriving (each in
      its hop's dtype, :func:`ring_dkv_hop_bytes`);
      building the message once the previous send has completed (it is dropped): the received accumulator
      converted to fp32 beside itself and the block grads (step 1 when the first hop came in the K/V dtype), the
      first message stacked from the diagonal's grads (step 0), the fp32 zero accumulator (step 0 with
      documents), the message and the buffer its hop arrives in, the last message rounded to the K/V dtype
      beside its fp32 sum;
      the end: the accumulator home and its dk, dv copied to the model's layout, then dq rounded beside fp32 dq.
    An off-diagonal block is every query row against half the keys (a key chunk of an earlier rank) or half the
    rows against every key (a later rank's): both occur at every step on some rank, so both are counted."""
    acc = max(act, 4)
    hop = ring_dkv_hop_bytes(cp, act, documents)
    dq = q * acc
    # With documents the blocks are chunk pairs: the diagonal's three, then two per step, each pair's dq added
    # before the next; counted all computed (one document per row: the most; a pair sharing no document is skipped)
    if documents:
        results = [act * (1.5 * e + q / 2)] + [act * (e + q / 2)] * (cp - 1)
        grads = [act * 1.5 * e] + [act * e] * (cp - 1)
    else:
        results = [act * (e + q)] + [act * max(e / 2 + q, e + q / 2)] * (cp - 1)
        grads = [act * e] + [act * e] * (cp - 1)
    points = []
    for step in range(cp):
        last = step == cp - 1
        kv = act * e * ((step > 0) + (not last))  # the K/V received and the K/V arriving
        sent = received = hop[step - 1] * e if step else 0.0
        points.append(dq + kv + sent + received + results[step])
        kv -= act * e if last else 0  # the last K/V is dropped once its blocks ran
        if step == 0 and not documents:
            points.append(dq + kv + grads[0] + act * e)  # the diagonal's grads stacked into the first message
        elif step == 0:
            points.append(dq + kv + grads[0] + acc * e)  # the zero accumulator
        # the sum is formed in the received buffer where it has the dtype the sum needs (the K/V dtype when the
        # last hop receives the first one: one block's grads added, one rounding), else in fp32
        summed = hop[step - 1] if step and last and hop[step - 1] == act else acc
        if step and hop[step - 1] != summed:
            points.append(dq + kv + received + acc * e + grads[step])  # the received accumulator converted
        if last and summed != act:
            points.append(dq + kv + acc * e + act * e)  # the fp32 sum rounded to the K/V dtype
        points.append(dq + kv + 2 * hop[step] * e)  # the message in flight and its hop arriving
    points += [dq + 2 * act * e, dq + act * e + act * q]  # home: dk, dv copied; dq rounded
    return max(points)


def cp_transient_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    cp: int = 2,
    cp_comm: str = "ring",
    attention: str = "sdpa",
    *,
    num_kv_heads: int | None = None,
    act_bytes: int = 2,
    documents: bool = False,
    head_dim: int | None = None,
) -> float:
    """Bytes one layer's cp_comm core holds only while it runs (its backward, the larger phase), per TP and CP
    rank; one layer at a time, so counted once per stage, not per layer.
    - ring: the most bytes of its own buffers alive at once in its backward (:func:`_ring_backward_peak`, step by
      step): the fp32 dQ accumulator; the K/V chunk in hand and the one arriving (double buffering: a buffer
      being sent is never written), [2, b, a_kv/t, s/cp, d] in activation bytes; the dK/dV accumulator this rank
      sent and the one arriving, in each hop's dtype (:func:`ring_dkv_hop_bytes`: fp32 on the middle hops, the
      K/V dtype on the first and last, so at cp 2 every hop without ``documents``, packed documents' ids); the
      block kernel's dq, dk, dv of the block in hand, and the copies a message or the result is made of.  Measured
      to the byte off the running ring's backward (every tensor it creates, in-process).  The forward holds less
      (two K/V buffers and the fp32 output accumulator).
    - a2a: dq, dk, dv of the head-sharded core and one all-to-all's send and receive buffers of q's size, in
      activation bytes.
    - the eager kernel also materialises its score block in fp32, about three [rows, keys] copies alive at once
      (scores, masked / shifted exponentials, probabilities): the ring's largest block is the diagonal pair,
      [b, a/t, s/cp, s/cp]; the a2a's is the whole sequence at a/(t cp) heads, [b, a/(t cp), s, s].
    ``head_dim``: a head's width where it is not h / a (Qwen3)."""
    d, kv = head_dim or h // a, a if num_kv_heads is None else num_kv_heads
    local = b * (s // cp) * d / t  # elements of one head-dim row set per head
    q_elems, kv_elems = local * a, 2 * local * kv  # q; K and V together
    if cp_comm == "ring":
        held = _ring_backward_peak(q_elems, kv_elems, cp, act_bytes, documents)
        scores = b * a / t * (s // cp) ** 2
    else:
        held = (3 * q_elems + kv_elems) * act_bytes
        scores = b * a / (t * cp) * s**2
    return held + (3 * 4 * scores if attention == "eager" else 0.0)


def rotary_table_bytes(
    s: int,
    h: int,
    a: int,
    cp: int = 1,
    *,
    family: str = DEFAULT_FAMILY,
    act_bytes: int = 2,
    head_dim: int | None = None,
) -> float:
    """The rotary cos/sin tables one process keeps for its blocks' backward: [s/cp, 1, 1, d] each in activation
    bytes, built once per process for the rank's positions and shared by every block (q * cos and rotate(q) * sin
    save them), so counted once per stage, not per layer; whole under TP and SP (rotary runs on q and k after
    SP's all-gather).  0 for a family with a learned position table (no rotary).  Packed documents with per-token
    positions build [s/cp, b, 1, d] tables once per micro-batch and stage instead, shared by its blocks (not
    counted here)."""
    if FAMILIES[family].layout.positions is not None:  # learned positions: an embedding row, no tables
        return 0.0
    return 2.0 * (s // cp) * (head_dim or h // a) * act_bytes


def lse_bytes_per_layer(s: int, b: int, a: int, t: int = 1) -> float:
    """The fused sdpa kernels' log-sum-exp per layer and TP rank: fp32 [b, a/t, s]."""
    return LSE_BYTES * a * s * b / t


def paper_units(s: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none") -> float:
    """The paper's per-layer activation memory in units of s*b*h bytes (2-byte activations, 1-byte masks)."""
    return activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel, recompute) / (s * h)


def stage_activations_in_flight(schedule: PipelineSchedule, pp: int, rank: int, num_micro_batches: int) -> float:
    """The most micro-batches' activations pipeline rank ``rank`` holds at once, in units of one micro-batch's
    activations of a 1F1B stage (L/p blocks), as counted off DeepSpeed's schedules (forward passes not yet
    backward): the schedule's record says (``Schedule.in_flight``; 1F1B min(p - rank, m), DualPipeV p + 1/2)."""
    return schedule.in_flight(pp, rank, num_micro_batches)


def stage_deferred_w_passes(schedule: PipelineSchedule, pp: int, rank: int, num_micro_batches: int) -> int:
    """The most queued W passes (each :func:`deferred_weight_grad_bytes_per_layer` per block) pipeline rank
    ``rank`` holds beside its activations in flight (``Schedule.w_held``; none without deferred weight
    gradients)."""
    return schedule.w_held(pp, rank, num_micro_batches)


def deferred_weight_grad_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    *,
    family: str = DEFAULT_FAMILY,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    cp: int = 1,
    act_bytes: int = 2,
    routed: RoutedShape | None = None,
    dense_layer: bool = False,
) -> float:
    """Bytes one layer's queued W pass keeps alive until it runs (zero-bubble schedules,
    ``ds_megatron.tensor_parallel.weight_grad``), per TP and CP rank: for each of the block's linears (the family's
    ``tuner.block_gemms``, m tokens x k in -> n out per TP rank) its input, m x k, and its output gradient, m x n,
    in activation bytes.  Under SP a column-parallel linear's input is the all-gathered [s, b, h], t times the shard
    the activation formula counts, so m is the whole s / cp x b whatever SP does.  These belong to a micro-batch
    whose B has run, so none of them is among :func:`activation_bytes_per_layer`'s micro-batches in flight.
    ``dense_layer``: a routed family's dense block."""
    kv = h // a * (a if num_kv_heads is None else num_kv_heads)
    width = 4 * h if intermediate_size is None else intermediate_size
    routed_kw = {} if routed is None else {"routed": routed, **({"dense": True} if dense_layer else {})}
    gemms = FAMILIES[family].tuner.block_gemms(b * (s // cp), h, kv, width, t, **routed_kw)
    return float(sum(count * m * (k + n) for _, m, k, n, count in gemms) * act_bytes)
