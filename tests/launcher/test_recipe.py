"""The demo end to end under the deepspeed launcher, generation parity, and its export matching transformers.
Exact resume is tested with a crash in test_reliability.py and for every shipped config in test_shipped_configs.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch import RECIPE, ROOT, Launch, deepspeed_launch, read_records, shared_launch, shared_token_cache

pytestmark = pytest.mark.slow  # every test here starts real processes with the deepspeed launcher

TINY = str(ROOT / "ds_configs" / "gpt_tiny.json")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One run of the demo config (4 processes, tp 2 x pp 2, SP, selective recompute), shared by the tests below,
    through the `deepspeed` command as the README runs it, with the data cache of the session's other runs of the
    same corpus and tokenizer (``shared_token_cache``: the BPE training and packing, which the runs that share it
    test, are not paid again)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    run_dir = tmp_path / "run"
    out = deepspeed_launch(
        RECIPE,
        4,
        [
            "--deepspeed_config",
            TINY,
            "--train-iters",
            "40",
            "--eval-interval",
            "20",
            "--save",
            str(tmp_path / "ck"),
            "--set",
            f"ds_megatron.logging.run_dir={run_dir}",
            "--set",
            f"ds_megatron.data.cache_dir={shared_token_cache()}",
            "--set",
            "ds_megatron.train.generate_tokens=6",
        ],
        command=True,
    )
    return tmp_path, run_dir, out


def test_demo_trains_and_reports(demo, eval_only):  # eval_only: its launch starts here, beside these checks
    tmp_path, run_dir, out = demo
    records = read_records(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    for r in records:
        if "loss" in r:
            assert {"step", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "step_ms"} <= r.keys()
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [20, 40] and all(math.isfinite(r["val_ppl"]) for r in vals)
    assert "validation | loss" in out and "perplexity" in out
    assert any("sample" in r for r in records)
    # the top-k sample: 6 tokens, or fewer when it drew EOS or ran into whitespace only; its text is its ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    sample = next(r for r in records if "sample_topk_ids" in r)
    ids, stop = sample["sample_topk_ids"], sample["sample_topk_stop"]
    assert (sample["sample_top_k"], sample["sample_temperature"]) == (40, 0.8)
    assert 1 <= len(ids) <= 6 and (len(ids) == 6 or stop != "length"), sample
    assert stop != "eos" or ids[-1] == tok.eos_token_id, sample
    assert stop != "blank" or all(not tok.decode([t]).strip() for t in ids[-4:]), sample
    assert sample["sample_topk"] == tok.decode(ids) and "sample (top-k 40, temperature 0.8) |" in out
    assert len(sample["sample_ids"]) == 6  # the greedy continuation keeps its full length
    # the loss curve: a PNG next to metrics.jsonl, its path printed
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss curve | {png}" in out
    # the offline wandb run holds the metrics
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in runs[0].iterdir())
    # the checkpoint carries the tokenizer next to the run and the resolved config
    assert (run_dir / "tokenizer" / "tokenizer.json").exists()
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step00000040"


# in the 2-process launch shared with other modules (launch.shared_launch)
GENERATE = shared_launch(__name__, 2, lambda out: [f"generate.py --out {out} --layout 2,1,1 --layout 1,2,1"])


def test_greedy_continuation_matches_single_device():
    files = sorted(GENERATE().glob("generate-*.json"))
    assert [f.name for f in files] == [f"generate-{x}.rank{r}.json" for x in ("121", "211") for r in (0, 1)]
    for f in files:
        r = json.loads(f.read_text())
        assert r["pipeline"] == r["reference"], (f.name, r)


def test_export_of_a_tp2_pp2_sp_run_matches_transformers(demo, eval_only, tmp_path):
    """Train at tp 2 x pp 2 with SP, export; transformers' logits equal ds_megatron's, its greedy
    generate equals the recipe's greedy continuation, and its validation loss equals the recipe's."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_megatron.checkpoint.__main__ import main as checkpoint_main
    from ds_megatron.checkpoint.adapter import StateDictAdapter
    from ds_megatron.config import resolve
    from ds_megatron.data import MicroBatchStream, PackedSamples, open_packed, split_train_valid
    from ds_megatron.data.corpus import launch_record
    from ds_megatron.model.gpt2.model import GPT, GPTConfig

    demo_dir, run_dir, _ = demo
    ck = demo_dir / "ck"
    hf_dir = tmp_path / "hf"
    # No --tokenizer: every save put the run's tokenizer in its tag, and export ships that one.
    assert checkpoint_main(["export", "--checkpoint", str(ck), "--out", str(hf_dir)]) == 0
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(run_dir / "tokenizer").get_vocab()
    records = read_records(run_dir)
    sample = next(r for r in records if "sample_ids" in r)
    prompt = torch.tensor([sample["prompt_ids"]])
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    assert generated[0, prompt.shape[1] :].tolist() == sample["sample_ids"]

    ours = GPT(GPTConfig.from_hf(model.config)).eval()
    ours.load_state_dict(StateDictAdapter.of(ours.config).from_hf_state_dict(model.state_dict()))
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - model(ids).logits).abs().max() <= 1e-5

    cfg = json.loads((run_dir / "config.json").read_text())
    # the packed file the run read: its cache's record for the run's data inputs names it
    packed = open_packed(Path(json.loads(launch_record(resolve(cfg, 4)).read_text())["cache_file"]))
    _, valid = split_train_valid(packed.tokens, cfg["ds_megatron"]["data"].get("valid_fraction", 0.02))
    seed = cfg["ds_megatron"]["train"]["seed"]
    stream = MicroBatchStream(PackedSamples(valid, 128, seed + 1), 4, 4, 0, 1)
    batch_losses = []
    with torch.no_grad():
        for _ in range(cfg["ds_megatron"]["train"]["eval_iters"]):
            micro = []
            for _ in range(4):
                x, y = next(stream)
                logits = model(x).logits
                micro.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
            batch_losses.append(float(torch.stack(micro).mean()))
    recipe_val = [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert abs(np.mean(batch_losses) - recipe_val) <= 1e-4, (np.mean(batch_losses), recipe_val)


EVAL_ONLY_TEST = "test_eval_only_reports_the_validation_loss_of_what_it_loads"


@pytest.fixture(scope="module")
def eval_only(demo, tmp_path_factory, request):
    """``--eval-only --load`` of the demo's checkpoint, started as soon as the demo ended when its test is selected:
    its one process runs beside the in-process checks of the demo's run and export (it reads the checkpoint and
    writes only its own run directory).  (the launch, the run directory), or None when its test is not selected."""
    if not any(item.originalname == EVAL_ONLY_TEST for item in request.session.items):
        return None
    demo_dir, _, _ = demo
    eval_dir = tmp_path_factory.mktemp("eval") / "run"
    args = ["--deepspeed_config", TINY, "--tp", "1", "--pp", "1", "--eval-only", "--load", str(demo_dir / "ck")]
    args += [
        "--set",
        f"ds_megatron.logging.run_dir={eval_dir}",
        "--set",
        f"ds_megatron.data.cache_dir={shared_token_cache()}",
    ]
    return Launch(RECIPE, 1, args), eval_dir


def test_eval_only_reports_the_validation_loss_of_what_it_loads(demo, eval_only):
    """``--eval-only --load``: the demo's last checkpoint, loaded at another layout (1 process: resharded on load),
    reports the validation loss the training run logged at that step, trains nothing and saves nothing."""
    demo_dir, run_dir, _ = demo
    launch, eval_dir = eval_only
    out = launch.finish()
    trained = [r for r in read_records(run_dir) if "val_loss" in r][-1]
    (evaluated,) = read_records(eval_dir)
    assert evaluated["step"] == trained["step"] == 40
    assert abs(evaluated["val_loss"] - trained["val_loss"]) <= 1e-5, (evaluated, trained)
    assert f"evaluation only: {demo_dir / 'ck'} (step 40) | validation loss" in out
    assert sorted(p.name for p in (demo_dir / "ck").iterdir() if p.name.startswith("step")) == ["step00000040"]
