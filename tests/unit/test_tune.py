"""The analytic hyperparameter tool (ds_megatron.tune): memory and time models, search, CLI, generated configs."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_megatron.config import ConfigError, ModelShape, resolve
from ds_megatron.config.numbers import finite_float
from ds_megatron.tune import (
    Candidate,
    Cluster,
    Measurement,
    Pins,
    build_cluster,
    build_model_shape,
    calibrate,
    search,
    stage_param_counts,
    step_time,
    total_param_count,
)
from ds_megatron.tune import __main__ as tune_cli
from ds_megatron.tune.__main__ import FLAGS, main
from ds_megatron.tune.core.memory_model import (
    GIB,
    layer_activation_bytes,
    padded_vocab_size,
    stage_activation_bytes,
    stored_activation_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
S = 2048
# (name, a, h, t) of the paper's models (Korthikanti et al. 2022), s = 2048
PAPER_MODELS = [("22B", 64, 6144, 8), ("175B", 96, 12288, 8), ("530B", 128, 20480, 8), ("1T", 160, 25600, 8)]
GPT3_175B = build_model_shape("gpt3-175b", None, None, None, None, S)
A100_1024 = Cluster(num_gpus=1024, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=312)
ARGS_175B = [
    "--model",
    "gpt3-175b",
    "--seq-length",
    "2048",
    "--global-batch-size",
    "1536",
    "--gpus",
    "1024",
    "--gpus-per-node",
    "8",
    "--gpu-memory-gb",
    "80",
    "--gpu-peak-tflops",
    "312",
]


@pytest.fixture(scope="module")
def timed_175b():
    start = time.perf_counter()
    result = search(GPT3_175B, A100_1024, 1536)
    return result, time.perf_counter() - start


@pytest.fixture(scope="module")
def result_175b(timed_175b):
    return timed_175b[0]


@pytest.fixture(scope="module", autouse=True)
def searched_once():
    """The command line's searches in this module, each request searched once: its tests read what the tool prints
    and writes, not how long the search took (``test_175b_on_1024_a100s`` times its own), so a repeated request (the
    175B one of the JSON test, asked again by the written-config test) is the same result."""
    memo = {}

    def once(model, cluster, global_batch_size, pins=None):
        key = (model, cluster, global_batch_size, pins)
        if key not in memo:
            memo[key] = search(model, cluster, global_batch_size, pins)
        return memo[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tune_cli, "search", once)
        yield memo


def _cand(t: int, sp: bool = False, **kw) -> Candidate:
    fields = dict(tp=t, pp=1, dp=1, sequence_parallel=sp, micro_batch_size=1, num_micro_batches=1, recompute="none")
    fields.update(kw)
    return Candidate(**fields)


# (a) per-layer activation memory: the paper's table, every mode


@pytest.mark.parametrize("name,a,h,t", PAPER_MODELS)
def test_per_layer_activations_reproduce_the_paper(name, a, h, t):
    model = build_model_shape(None, 1, h, a, 51200, S)
    q = 5 * a * S / h

    def units(cand: Candidate, policy: str) -> float:
        return layer_activation_bytes(model, cand, policy) / (S * h)

    assert units(_cand(1), "none") == pytest.approx(34 + q)
    assert units(_cand(t), "none") == pytest.approx(10 + 24 / t + q / t)
    assert units(_cand(t, sp=True), "none") == pytest.approx((34 + q) / t)
    assert units(_cand(t), "selective") == pytest.approx(10 + 24 / t)
    assert units(_cand(t, sp=True), "selective") == pytest.approx(34 / t)
    assert units(_cand(t), "full") == pytest.approx(2)
    assert units(_cand(t, sp=True), "full") == pytest.approx(2 / t)


def test_published_175b_activation_ratio():
    # 23 vs 4.25 s*b*h bytes per layer at t = 8: about 5x less with SP + SAR.
    tp_only = layer_activation_bytes(GPT3_175B, _cand(8), "none") / (S * 12288)
    sp_sar = layer_activation_bytes(GPT3_175B, _cand(8, sp=True), "selective") / (S * 12288)
    assert tp_only == pytest.approx(23.0, abs=0.05) and sp_sar == pytest.approx(4.25)


def test_pipeline_and_recompute_activation_terms():
    model = build_model_shape(None, 16, 1024, 16, 50257, S)
    per_layer = layer_activation_bytes(model, _cand(2), "selective")
    block_input = layer_activation_bytes(model, _cand(2), "full")
    # 1F1B: the first stage keeps min(p, m) micro-batches of its ceil(L/p) = 4 blocks (+ the embedding dropout
    # mask), the last stage one (+ final LayerNorm and output-layer inputs and bf16 + fp32 logits); both add the one
    # s x s core that selective recompute re-creates during a backward.
    core = layer_activation_bytes(model, _cand(2), "none") - per_layer
    mask = S * 1024 * 1
    logits = 6 * S * padded_vocab_size(50257, 2) / 2
    for m, in_flight in ((8, 4), (2, 2)):
        cand = _cand(2, pp=4, dp=1, num_micro_batches=m, recompute="selective")
        first, last = stage_activation_bytes(model, cand)
        assert first == pytest.approx(in_flight * (4 * per_layer + mask) + core)
        assert last == pytest.approx(4 * per_layer + 2 * 2 * S * 1024 + logits + core)
    # full recompute, 8 blocks: uniform k=3 keeps ceil(8/3) = 3 inputs; block k=3 keeps 3 inputs + 5 whole blocks.
    whole = layer_activation_bytes(model, _cand(2), "none")
    uniform = _cand(2, recompute="full", recompute_layers=3, recompute_method="uniform")
    block = _cand(2, recompute="full", recompute_layers=3, recompute_method="block")
    assert stored_activation_bytes(model, uniform, 8) == pytest.approx(3 * block_input)
    assert stored_activation_bytes(model, block, 8) == pytest.approx(3 * block_input + 5 * whole)


# (b) the search


def test_175b_on_1024_a100s(timed_175b):
    r, wall_s = timed_175b
    w = r.winner
    assert wall_s < 10.0
    assert w is not None and w.fits and w.required_bytes <= 80 * GIB
    assert r.common is not None and r.speedup is not None and r.speedup > 1.0
    c = r.common.candidate
    assert (c.tp, c.sequence_parallel, c.recompute, c.recompute_layers, c.recompute_method) == (
        8,
        False,
        "full",
        1,
        "uniform",
    )
    assert 0.2 < w.time.mfu < 0.6 and w.candidate.tp * w.candidate.pp * w.candidate.dp == 1024
    print(
        f"\n175B on 1024 x A100-80GB, batch 1536: winner {w.candidate.settings()} "
        f"MFU {w.time.mfu:.1%}, {w.time.step_s:.2f} s/step; common {c.settings()} {r.common.time.step_s:.2f} s/step; "
        f"speed-up {r.speedup:.2f}x; search {wall_s:.2f} s ({len(r.evaluations)} candidates)"
    )


def test_every_candidate_respects_the_rules(result_175b):
    for e in result_175b.evaluations:
        c = e.candidate
        assert c.tp * c.pp * c.dp == 1024 and 96 % c.tp == 0 and c.tp <= 8
        assert c.num_micro_batches * c.dp * c.micro_batch_size == 1536 and c.num_micro_batches >= c.pp
        assert not (c.sequence_parallel and c.tp == 1) and c.zero == 1
        assert e.fits == (e.reason is None)
    ranked = [e.time.step_s for e in result_175b.ranked]
    assert ranked == sorted(ranked)


def test_common_configuration_uses_the_smallest_pp_that_fits(result_175b):
    common = result_175b.common.candidate
    smaller = [
        e
        for e in result_175b.evaluations
        if e.candidate.tp == 8
        and e.candidate.pp < common.pp
        and not e.candidate.sequence_parallel
        and e.candidate.recompute == "full"
        and e.candidate.recompute_layers == 1
        and e.candidate.recompute_method == "uniform"
    ]
    assert smaller and not any(e.fits for e in smaller)


def test_pins_restrict_the_candidates():
    pins = Pins(tp=4, pp=16, micro_batch_size=1, sequence_parallel=True, recompute="selective")
    result = search(GPT3_175B, A100_1024, 1536, pins)
    assert result.evaluations
    for e in result.evaluations:
        c = e.candidate
        assert (c.tp, c.pp, c.dp, c.micro_batch_size, c.sequence_parallel, c.recompute) == (
            4,
            16,
            16,
            1,
            True,
            "selective",
        )
    full = search(GPT3_175B, A100_1024, 1536, Pins(recompute="full", dp=32))
    assert full.evaluations and {(e.candidate.recompute, e.candidate.dp) for e in full.evaluations} == {("full", 32)}


def test_impossible_request_explains_itself(capsys):
    small = Cluster(num_gpus=8, gpus_per_node=8, gpu_memory_gb=16, peak_tflops=312)
    result = search(GPT3_175B, small, 64)
    assert result.winner is None and result.speedup is None and result.rejections
    assert all(r.reason for r in result.rejections)
    families = {
        (e.candidate.tp, e.candidate.pp, e.candidate.sequence_parallel, e.candidate.recompute)
        for e in result.evaluations
    }
    reported = {
        (r.family["tp"], r.family["pp"], r.family["sequence_parallel"], r.family["recompute"])
        for r in result.rejections
        if r.required_bytes is not None
    }
    assert families == reported  # every evaluated family is rejected with an out-of-memory reason
    rc = main(["--model", "gpt3-175b", "--global-batch-size", "64", "--gpus", "8", "--gpu-memory-gb", "16"])
    out = capsys.readouterr().out
    assert rc == 1 and "no configuration fits" in out and "out of memory" in out and "add GPUs or memory" in out


def test_time_model_parts():
    model = build_model_shape("gpt3-13b", None, None, None, None, S)
    cluster = Cluster(num_gpus=64, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=312)
    base = Candidate(8, 4, 2, False, 1, 64, "selective")
    t = step_time(model, cluster, base, 128)
    # the bubble is (p - 1)/m of the ideal (non-bubble) pipeline time
    assert t.bubble_s / (t.step_s - t.dp_comm_s - t.bubble_s) == pytest.approx(3 / 64)
    sp = step_time(model, cluster, dataclasses.replace(base, sequence_parallel=True), 128)
    assert sp.p2p_s < t.p2p_s / 3  # boundary tensors are s/t rows under SP (latency unchanged)
    full = step_time(model, cluster, dataclasses.replace(base, recompute="full"), 128)
    assert full.step_s > t.step_s and full.hfu > full.mfu and full.mfu < t.mfu
    assert 0 < t.mfu < t.hfu < 1


def test_calibrate_recovers_the_efficiency():
    model = build_model_shape("gpt3-6.7b", None, None, None, None, S)
    truth = Cluster(num_gpus=32, gpus_per_node=8, gpu_memory_gb=80, peak_tflops=312, efficiency=0.37)
    runs = [Candidate(4, 2, 4, True, 1, 32, "selective"), Candidate(8, 1, 4, False, 2, 16, "full")]
    measured = [Measurement(model, truth, c, 128, step_time(model, truth, c, 128).step_s) for c in runs]
    guess = dataclasses.replace(truth, efficiency=0.9)  # calibrate ignores the efficiency it is given
    measured = [dataclasses.replace(m, cluster=guess) for m in measured]
    assert calibrate(measured) == pytest.approx(0.37, rel=1e-6)
    with pytest.raises(ValueError):
        calibrate([])


# CLI: JSON, config, errors


def test_json_has_every_candidate_and_reason(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main([*ARGS_175B, "--top", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "winner:" in printed and "speed-up" in printed and "MFU" in printed
    data = json.loads(out.read_text())
    assert data["winner"] is not None and data["speedup_over_common"] > 1 and data["rejected"]
    for cand in data["candidates"]:
        for key in ("tp", "pp", "dp", "sequence_parallel", "micro_batch_size", "num_micro_batches", "recompute"):
            assert key in cand
        for key in ("step_time_s", "tokens_per_s", "mfu", "fits"):
            assert key in cand
        for stage in ("first_stage", "last_stage"):
            mem = cand["memory"][stage]
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes"):
                assert mem[key] > 0
            assert "activation_bytes_per_layer" in mem
    assert all(r["reason"] for r in data["rejected"])


@pytest.mark.parametrize(
    "extra,world",
    [([], 1024), (["--recompute", "full", "--tp", "2"], 1024)],
)
def test_written_config_resolves(tmp_path, capsys, extra, world):
    path = tmp_path / "winner.json"
    assert main([*ARGS_175B, *extra, "--write-config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert f"deepspeed --hostfile hostfile recipes/train_gpt.py --deepspeed_config {path}" in printed
    cfg = json.loads(path.read_text())
    run = resolve(cfg, world)
    section = cfg["ds_megatron"]
    assert (run.tp, run.pp) == (section["parallel"]["tp"], section["parallel"]["pp"])
    assert run.micro_batch_size * run.grad_accum_steps * run.dp == 1536
    assert cfg["bf16"] == {"enabled": True} and cfg["zero_optimization"]["stage"] == 1
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert set(section["recompute"]) == {"policy", "num_layers", "method"}
    if extra:
        assert section["recompute"]["policy"] == "full" and run.tp == 2


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--gpus", "0"], "error: --gpus: must be positive"),
        (["--tp", "5"], "error: --tp: num_heads not divisible by tp (num_heads=96, tp=5)"),
        (["--model", "gpt3-17b"], "error: --model: unknown size"),
        (["--gpus", "many"], "error: command line: argument --gpus: invalid int value"),
        (["--pp", "3"], "error: --gpus: the pinned dimensions do not divide the GPU count"),
        (["--tp", "1", "--sequence-parallel"], "error: --sequence-parallel: needs tp > 1"),
        (  # the config's batch-split rule, in the tuner's flags
            ["--dp", "4", "--micro-batch-size", "5"],
            "error: --global-batch-size: the global batch does not split into micro batches over dp "
            "(--global-batch-size=1536, --micro-batch-size=5, dp=4); set --global-batch-size to a multiple of 20",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, expected):
    assert main([*ARGS_175B, *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), captured.err
    assert captured.out == ""


FLOAT_FLAGS = [flag for rows in FLAGS.values() for flag, options, _ in rows if options.get("type") is finite_float]


def test_every_float_flag_refuses_nan_and_infinity(capsys):
    """A NaN passes every range check written as a comparison (``nan <= 0`` is false) and an infinite memory makes
    everything fit: each float flag refuses them as it is parsed, and the Python API's cluster check too."""
    assert len(FLOAT_FLAGS) >= 10 and "--gpu-memory-gb" in FLOAT_FLAGS and "--step-overhead-s" in FLOAT_FLAGS
    for flag in FLOAT_FLAGS:
        for text in ("nan", "inf", "-inf", "NaN", "Infinity"):
            assert main([*ARGS_175B, f"{flag}={text}"]) == 2, (flag, text)
            captured = capsys.readouterr()
            lines = captured.err.strip().splitlines()
            expected = f"error: command line: argument {flag}: must be a finite number, got {text!r}"
            assert len(lines) == 1 and lines[0].startswith(expected) and captured.out == "", captured.err
    for field, flag in (("gpu_memory_gb", "--gpu-memory-gb"), ("step_overhead_s", "--step-overhead-s")):
        for value in (math.nan, math.inf):
            cluster = build_cluster("a100-80gb", 8, 8, **{field: value})
            with pytest.raises(ConfigError, match=f"^error: {flag}: must be a finite number"):
                search(GPT3_175B, cluster, 64)


TINY_ARGS = [
    "--model",
    "gpt-tiny",
    "--vocab",
    "1024",
    "--seq-length",
    "128",
    "--global-batch-size",
    "16",
    "--gpus",
    "4",
]


@pytest.mark.parametrize("flag", ["--write-config", "--json"])
def test_output_files_are_never_replaced_without_force(tmp_path, capsys, flag):
    """An existing file is refused unless --force, a missing directory (or a directory as the file) is refused, all
    before any work: one line, exit 2, nothing printed, nothing written."""
    path = tmp_path / "out.json"
    path.write_text("someone's file")
    missing = tmp_path / "no" / "such"
    for target, expected in (
        (path, f"error: {flag}: the file exists ({path}); pass --force"),
        (missing / "out.json", f"error: {flag}: the directory does not exist ({missing} for {missing / 'out.json'})"),
        (tmp_path, f"error: {flag}: is a directory ({tmp_path})"),
    ):
        assert main([*TINY_ARGS, flag, str(target)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected) and captured.out == "", captured.err
    assert path.read_text() == "someone's file" and not (tmp_path / "no").exists()
    assert main([*TINY_ARGS, flag, str(path), "--force"]) == 0
    assert json.loads(path.read_text()) and f"to {path}" in capsys.readouterr().out
    assert main([*TINY_ARGS, "--json", str(path), "--write-config", str(tmp_path / "." / "out.json"), "--force"]) == 2
    assert "error: --write-config: names the same file as --json" in capsys.readouterr().err


def test_cli_runs_without_torch_or_deepspeed():
    probe = (
        "import sys; from ds_megatron.tune.__main__ import main; "
        "rc = main(['--model', 'gpt3-1.3b', '--global-batch-size', '512', '--gpus', '16', '--top', '2']); "
        "print('heavy' if {'torch', 'deepspeed'} & set(sys.modules) else 'clean'); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("clean") and "winner:" in proc.stdout


def test_tune_imports_only_config_memory_flops_and_the_stdlib():
    # and the checkpoint manifest (standard library only: which tag of a run is complete, and its config), which the
    # inference half reads a trained model's shape from, and the family registry and records (standard library only:
    # tests/unit/test_layering.py), which hold each family's terms, and the pipeline schedules' records (standard
    # library only: the tuner times the very order the engine runs), and the GPU peaks (standard library only: MFU
    # reads them too)
    allowed = {"ds_megatron.config", "ds_megatron.memory", "ds_megatron.flops", "ds_megatron.tune"}
    allowed |= {"ds_megatron.checkpoint.manifest", "ds_megatron.model", "ds_megatron.pipeline_parallel.schedules"}
    allowed |= {"ds_megatron.gpus"}
    for path in (ROOT / "ds_megatron" / "tune").rglob("*.py"):  # the core and both halves
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top == "ds_megatron":
                    assert any(name == a or name.startswith(a + ".") for a in allowed), f"{path.name}: {name}"
                else:
                    assert top in sys.stdlib_module_names or top == "__future__", f"{path.name}: {name}"


# (c) parameter counts against the real model


def _gpt(model: ModelShape):
    from ds_megatron.model.gpt2.model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=model.vocab_size,
        n_positions=model.seq_length,
        n_embd=model.hidden_size,
        n_layer=model.num_layers,
        n_head=model.num_heads,
    )
    return GPT(cfg), cfg


@pytest.mark.parametrize("shape", [(4, 64, 4, 257, 32), (2, 96, 6, 1000, 48)])
def test_param_count_equals_the_real_gpt(shape):
    model = build_model_shape(None, *shape)
    gpt, _ = _gpt(model)
    real = sum(p.numel() for p in gpt.parameters())
    assert total_param_count(model) == real  # the single-device GPT has no vocabulary padding
    first, last = stage_param_counts(model, 1, 1)  # what the tuner uses: vocabulary padded to 128
    assert first == last and abs(first - real) / real < 0.05
    gpt3 = build_model_shape("gpt3-125m", None, None, None, None, 2048)
    assert abs(stage_param_counts(gpt3, 1, 1)[0] / total_param_count(gpt3) - 1) < 0.01


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_param_counts_follow_the_shard_rules(tp):
    """pp 2 over 4 blocks: stage 0 = wte, wpe, h.0, h.1; stage 1 = h.2, h.3, ln_f, tied wte.  Each parameter's
    size on TP rank 0 comes from the project's own shard rules."""
    from ds_megatron.parallelize import ParallelContext, shard_rule
    from ds_megatron.tensor_parallel.sharding import shard
    from ds_megatron.topology import Group

    model = build_model_shape(None, 4, 64, 4, 257, 32)
    gpt, cfg = _gpt(model)
    plan = ParallelContext(cfg, Group(size=tp), False, None)
    local = {name: shard(p.data, shard_rule(name, plan), 0, tp).numel() for name, p in gpt.named_parameters()}
    first_names = ("transformer.wte.", "transformer.wpe.", "transformer.h.0.", "transformer.h.1.")
    last_names = ("transformer.h.2.", "transformer.h.3.", "transformer.ln_f.", "transformer.wte.")
    first = sum(n for name, n in local.items() if name.startswith(first_names))
    last = sum(n for name, n in local.items() if name.startswith(last_names))
    assert stage_param_counts(model, tp, 2) == (first, last)
    # by hand at tp 2: V_pad = 256 x 2 = 512 rows, h = 64, s = 32
    if tp == 2:
        block = (12 * 64 * 64 + 7 * 64) // 2 + 6 * 64  # split matrices and column biases, replicated norms/row biases
        assert padded_vocab_size(257, 2) == 512 and block == 25184
        assert (first, last) == (512 * 64 // 2 + 32 * 64 + 2 * block, 2 * block + 2 * 64 + 512 * 64 // 2)


def test_measured_block_activations_match_the_fp32_prediction():
    """One GPTBlock on CPU in fp32: bytes saved for backward (each storage once, parameters excluded) against the
    tuner's per-layer prediction with 4-byte activations and the mask size this torch saves."""
    import torch

    from ds_megatron.model.gpt2.model import GPTBlock, GPTConfig

    s, b, h, a = 128, 2, 128, 4
    mask_sizes: list[int] = []
    probe = torch.ones(64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: mask_sizes.append(t.element_size()) or t, lambda t: t):
        torch.nn.functional.dropout(probe, 0.5, training=True)
    torch.manual_seed(0)
    block = GPTBlock(GPTConfig(vocab_size=64, n_positions=s, n_embd=h, n_layer=1, n_head=a)).train()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(s, b, h, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    y.sum().backward()
    model = build_model_shape(None, 1, h, a, 64, s)
    predicted = layer_activation_bytes(model, _cand(1, micro_batch_size=b), "none", 4, max(mask_sizes))
    measured = sum(seen.values())
    print(
        f"\nGPTBlock fp32 saved bytes: measured {measured}, predicted {predicted:.0f}, ratio {measured / predicted:.3f}"
    )
    assert math.isclose(measured, predicted, rel_tol=0.15), (measured, predicted)
