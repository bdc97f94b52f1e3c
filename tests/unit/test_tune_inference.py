"""The tuner's inference half: its terms against hand-derived figures, its physical floors, the search and the
command line (bad input, nothing fits, nothing meets the limits, the model sources)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds_megatron.tune import build_cluster, build_model_shape
from ds_megatron.tune.core.memory_model import block_param_count, total_param_count
from ds_megatron.tune.inference.cli import main
from ds_megatron.tune.inference.engines import BANDWIDTH_EFFICIENCY, ENGINES, inference_cluster
from ds_megatron.tune.inference.model import (
    PRECISION_BYTES,
    Serving,
    Workload,
    evaluate_serving,
    kv_cache_bytes_per_token,
    search_inference,
)

LLAMA8B = build_model_shape("llama3-8b", None, None, None, None, None)
H200 = build_cluster("h200", 8, 8)
WORK = Workload(prompt_length=2048, output_length=256)


def test_kv_cache_of_llama3_8b_is_128_kib_per_token_in_bf16():
    assert kv_cache_bytes_per_token(LLAMA8B, "bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_cache_bytes_per_token(LLAMA8B, "fp8", tp=2) == 32 * 1024
    mha = dataclasses.replace(LLAMA8B, num_kv_heads=32)  # without grouped-query attention: 4x the cache
    assert kv_cache_bytes_per_token(mha, "bf16") == 4 * kv_cache_bytes_per_token(LLAMA8B, "bf16")


def test_decode_of_llama3_8b_at_batch_1_on_one_h200_is_bound_by_its_weights():
    """7.50B bf16 weights read per token (the 8.03B less the input embedding, which is looked up) at 4.8 TB/s:
    3.13 ms.  At the raw bandwidth and no overhead the prediction sits on that floor; with the fitted constants
    (reads at 78.2% of the bandwidth, DeepSpeed's 2.52 ms per forward) it is the floor / 0.782 + 2.52 ms."""
    raw = dataclasses.replace(build_cluster("h200", 1, 8), efficiency=1.0)
    work = Workload(prompt_length=128, output_length=128)
    e = evaluate_serving(LLAMA8B, raw, Serving(1, 1, 1, 1), work)
    read = (LLAMA8B.num_layers * block_param_count(LLAMA8B) + LLAMA8B.vocab_size * LLAMA8B.hidden_size) * 2
    floor = read / 4.8e12
    kv = (128 + 127 / 2) * kv_cache_bytes_per_token(LLAMA8B, "bf16") / 4.8e12  # the mean context's cache, 5 us
    assert 3.1e-3 < floor < 3.15e-3 and e.time.decode_bytes_floor_s == pytest.approx(floor + kv, rel=1e-9)
    assert floor <= e.time.tpot_s < 1.01 * floor, (floor, e.time.tpot_s)
    assert e.fits and e.memory.weights == pytest.approx(total_param_count(LLAMA8B, vocab_multiple=128) * 2, rel=0.01)
    fitted = evaluate_serving(LLAMA8B, inference_cluster(raw, "deepspeed"), Serving(1, 1, 1, 1), work)
    assert fitted.time.tpot_s == pytest.approx(
        floor / BANDWIDTH_EFFICIENCY + ENGINES["deepspeed"].step_overhead_s, rel=0.01
    )


@pytest.mark.parametrize("efficiency", [0.5, 0.869, 1.5])
@pytest.mark.parametrize(
    "name,gpu,weights,kv_dtype",
    [
        ("llama3-8b", "h200", "bf16", "bf16"),
        ("llama3-70b", "h100-sxm", "fp8", "fp8"),
        ("gpt3-1.3b", "a100-80gb", "bf16", "bf16"),
    ],
)
def test_no_prediction_below_the_physical_floors(name, gpu, weights, kv_dtype, efficiency):
    """TPOT never below the weights and KV cache of a GPU over its HBM bandwidth; TTFT never below the prefill's
    FLOPs over its peak: computed here from the shape alone, for every candidate, even at an efficiency above 1."""
    model = build_model_shape(name, None, None, None, None, None)
    cluster = dataclasses.replace(build_cluster(gpu, 8, 8), efficiency=efficiency)
    work = Workload(prompt_length=1024, output_length=64, weight_dtype=weights, kv_dtype=kv_dtype)
    result = search_inference(model, cluster, work)
    assert result.evaluations
    # Per token every rank reads its share of every block and of one vocabulary table (the stages run one after
    # another for a batch); the input embedding is looked up, not read whole.
    read = model.num_layers * block_param_count(model) + model.vocab_size * model.hidden_size
    bw, peak = cluster.memory_gbps * 1e9, cluster.matmul_peak_flops(weights)  # fp8 matmuls at the fp8 peak
    for e in result.evaluations:
        s = e.serving
        kv = s.batch * (work.prompt_length + 31.5) * kv_cache_bytes_per_token(model, kv_dtype, s.tp)
        assert e.time.tpot_s >= (read * PRECISION_BYTES[weights] / s.tp + kv) / bw * 0.999, s
        prefill_flops = 2 * model.num_layers * block_param_count(model) * s.batch * work.prompt_length / s.tp
        assert e.time.ttft_s >= prefill_flops / peak * 0.999, s


def test_batching_trades_tpot_for_throughput_and_tp_cuts_latency():
    big = build_model_shape("llama3-70b", None, None, None, None, None)
    times = [evaluate_serving(big, H200, Serving(4, 1, b, 2), WORK) for b in (1, 8, 64)]
    assert times[0].time.tpot_s < times[1].time.tpot_s < times[2].time.tpot_s
    assert times[0].tokens_per_s < times[1].tokens_per_s < times[2].tokens_per_s
    tpot = [evaluate_serving(big, H200, Serving(t, 1, 1, 8 // t), WORK).time.tpot_s for t in (2, 4, 8)]
    assert tpot[0] > tpot[1] > tpot[2]


def test_search_winner_meets_the_limit_and_the_front_is_not_dominated():
    work = dataclasses.replace(WORK, max_tpot_s=0.010)
    result = search_inference(LLAMA8B, H200, work)
    w = result.winner
    assert w is not None and w.time.tpot_s <= 0.010 and w.fits
    assert all(w.tokens_per_s >= e.tokens_per_s for e in result.qualifying)
    front = result.pareto_front()
    assert w in front and len(front) < len(result.evaluations)
    for a in front:
        for b in result.evaluations:
            assert not (
                b.tokens_per_s_per_gpu > a.tokens_per_s_per_gpu
                and b.time.tpot_s < a.time.tpot_s
                and b.time.ttft_s < a.time.ttft_s
            )
    assert all(e.serving.tp * e.serving.pp * e.serving.replicas <= 8 for e in result.evaluations)


BASE = ["--gpu", "h200", "--gpus", "8", "--prompt-length", "2048", "--output-length", "256"]


def test_cli_report_and_json(tmp_path, capsys):
    out = tmp_path / "inference.json"
    assert main(["--model", "llama3-8b", *BASE, "--max-tpot-ms", "20", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "winner: tp " in text and "why: " in text and "Pareto front" in text
    data = json.loads(out.read_text())
    assert data["winner"]["tpot_s"] <= 0.020 and data["pareto_front"] and data["candidates"]


def test_cli_a_limit_nothing_meets_lists_the_closest(capsys):
    assert main(["--model", "llama3-8b", *BASE, "--max-tpot-ms", "0.5"]) == 1
    text = capsys.readouterr().out
    assert "no configuration meets the limits; the closest" in text and "missed" in text


def test_cli_a_model_that_fits_nowhere_says_why(capsys):
    args = ["--model", "llama3-70b", "--gpu", "a100-40gb", "--gpus", "1", "--prompt-length", "512"]
    assert main([*args, "--output-length", "64"]) == 1
    assert "nothing fits: at tp 1 x pp 1 and batch 1 a GPU needs" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,setting",
    [
        (["--prompt-length", "0", "--output-length", "8"], "--prompt-length"),
        (["--prompt-length", "8000", "--output-length", "500"], "--output-length"),
        (["--prompt-length", "8", "--output-length", "8", "--kv-dtype", "int4x"], "--kv-dtype"),
        (["--prompt-length", "8", "--output-length", "8", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["--prompt-length", "8", "--output-length", "8", "--batch-sizes", "0"], "--batch-sizes"),
        (["--prompt-length", "8", "--output-length", "8", "--max-ttft-ms", "-1"], "--max-ttft-ms"),
        (
            ["--prompt-length", "8", "--output-length", "8", "--max-tpot-ms", "nan"],
            "command line: argument --max-tpot-ms",
        ),
    ],
)
def test_cli_bad_input_is_one_line(args, setting, capsys):
    assert main(["--model", "llama3-8b", "--gpu", "h200", "--gpus", "8", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {setting}: ") and ";" in err[0], err


def test_cli_one_model_source(capsys, tmp_path):
    assert main(["--model", "llama3-8b", "--hf-dir", str(tmp_path), *BASE]) == 2
    assert "error: --model: one model source needed" in capsys.readouterr().err


def test_the_model_from_an_exported_directory_and_from_a_checkpoint(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    hf_config = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }
    (hf / "config.json").write_text(json.dumps(hf_config))
    assert main(["--hf-dir", str(hf), *BASE, "--json", str(tmp_path / "a.json")]) == 0
    assert main(["--model", "llama3-8b", *BASE, "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a["candidates"] == b["candidates"]  # the same shape, hence the same predictions

    tag = tmp_path / "ck" / "step00000010"
    tag.mkdir(parents=True)
    section = {"model": {"size": "llama3-8b"}}
    (tag / "config.json").write_text(json.dumps({"ds_megatron": section}))
    (tag / "manifest.json").write_text(json.dumps({"step": 10, "files": {}}))
    assert main(["--checkpoint", str(tmp_path / "ck"), *BASE, "--json", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["candidates"] == b["candidates"]
    capsys.readouterr()
    assert main(["--hf-dir", str(tmp_path), *BASE]) == 2
    assert "error: --hf-dir: no config.json" in capsys.readouterr().err


def test_a_gpt2_directory_is_read_through_the_family_records_field_map(tmp_path):
    """transformers' GPT-2 keys (n_layer, n_embd, n_head, n_positions) reach the shape through the gpt2 record."""
    from ds_megatron.tune.inference.cli import hf_model_shape

    hf = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 2048}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shape = hf_model_shape(str(tmp_path), None)
    assert (shape.family, shape.num_layers, shape.hidden_size, shape.num_heads) == ("gpt2", 12, 768, 12)
    assert (shape.vocab_size, shape.seq_length, shape.max_position_embeddings) == (50257, 2048, 2048)


QWEN3_30B = build_model_shape("qwen3-30b-a3b", None, None, None, None, None)


def test_a_mixture_of_experts_holds_every_expert_and_reads_those_its_tokens_touch():
    """Qwen3-30B-A3B (E 128, k 8) on one H200 in bf16: the weights of all 30.5B parameters in memory; decode at batch
    1 reads the non-expert weights and k experts per routed layer (3.3B of the weights: "A3B"), at batch B the
    E (1 - (1 - k/E)^B) experts B tokens touch (29.1 at B 4, all 128 in the limit), and multiplies k per token."""
    from ds_megatron.tune.inference.model import block_params_read, expert_params, experts_touched

    raw = dataclasses.replace(build_cluster("h200", 1, 8), efficiency=1.0)
    work = Workload(prompt_length=128, output_length=128)
    e = evaluate_serving(QWEN3_30B, raw, Serving(1, 1, 1, 1), work)
    assert e.memory.weights == pytest.approx(total_param_count(QWEN3_30B, vocab_multiple=128) * 2, rel=0.01)
    assert 30e9 < total_param_count(QWEN3_30B) < 31e9
    assert experts_touched(128, 8, 1) == pytest.approx(8) and experts_touched(128, 8, 4) == pytest.approx(29.1, abs=0.1)
    assert experts_touched(128, 8, 4096) == pytest.approx(128)
    per_expert, layers = expert_params(QWEN3_30B, 1), QWEN3_30B.num_layers
    assert per_expert == 3 * 2048 * 768
    one = block_params_read(QWEN3_30B, 1, 1)
    assert one == pytest.approx(block_param_count(QWEN3_30B) - 120 * per_expert)
    h, v = QWEN3_30B.hidden_size, 151936
    active = layers * one + h * v  # read per decode step at batch 1 (the output layer's table, not the embedding)
    assert 3.0e9 < active < 3.5e9
    kv = (128 + 127 / 2) * kv_cache_bytes_per_token(QWEN3_30B, "bf16") / 4.8e12
    assert e.time.decode_bytes_floor_s == pytest.approx(active * 2 / 4.8e12 + kv, rel=1e-3)
    # batching reads more experts per step, but far fewer than a dense model of the same size
    four = evaluate_serving(QWEN3_30B, raw, Serving(1, 1, 4, 1), work)
    assert four.time.decode_bytes_floor_s > 2 * e.time.decode_bytes_floor_s
    assert four.time.tpot_s < 4 * e.time.tpot_s
    result = search_inference(QWEN3_30B, build_cluster("h100-sxm", 8, 8), WORK)
    assert result.winner is not None and result.winner.fits


def test_the_measuring_run_refuses_a_mixture_of_experts():
    from ds_megatron.config import ConfigError
    from ds_megatron.tune.inference.empirical import InferenceEmpiricalOptions, validate_options

    result = search_inference(QWEN3_30B, build_cluster("h100-sxm", 8, 8), WORK)
    with pytest.raises(ConfigError, match=r"--empirical.*dense models only.*128 experts"):
        validate_options(result, InferenceEmpiricalOptions(max_minutes=1.0), "some/dir")
