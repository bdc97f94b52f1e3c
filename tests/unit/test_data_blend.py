"""Weighted blends of prepared directories: proportions, determinism, exact resume, and bad blends refused in one
line before anything starts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_data_prepare import make_tokenizer, run_prepare, write_corpus
from test_data_training import TINY, recipe

from ds_megatron.config import ConfigError, resolve
from ds_megatron.data import BlendedSamples, MicroBatchStream, PackedSamples
from ds_megatron.data.blend import BLOCK, block_counts
from ds_megatron.data.prepare import prepare_data
from ds_megatron.preflight import check_data


class Source:
    """Sample j of source d is the tensor [d, j]."""

    def __init__(self, d: int, n: int = 10**9):
        self.d, self.num_samples = d, n

    def __getitem__(self, j: int) -> torch.Tensor:
        return torch.tensor([self.d, j])


def test_block_counts_sum_to_the_block_by_largest_remainder():
    assert block_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
    assert block_counts([0.7, 0.3, 0.0]).tolist() == [2867, 1229, 0]
    for bad in ([-1, 2], [0, 0], [], [float("nan"), 1]):
        with pytest.raises(ValueError):
            block_counts(bad)


def test_proportions_within_one_percent_and_each_source_read_in_order():
    weights = [0.6, 0.3, 0.08, 0.02]
    blend = BlendedSamples([Source(d) for d in range(4)], weights, seed=5)
    n = 250_000
    drawn = [blend.locate(k) for k in range(n)]
    counts = np.bincount([d for d, _ in drawn], minlength=4)
    assert np.allclose(counts / n, weights, rtol=0.01), counts / n
    assert counts.tolist() == blend.realised(n).tolist()
    for d in range(4):  # every source walks through its samples 0, 1, 2, ... without gaps or repeats
        assert [j for s, j in drawn if s == d] == list(range(counts[d]))
    window = np.bincount([d for d, _ in drawn[BLOCK * 7 : BLOCK * 8]], minlength=4)
    assert window.tolist() == blend.counts.tolist()  # exact in every block
    assert len({tuple(d for d, _ in drawn[i : i + 64]) for i in range(0, 4096, 64)}) > 50  # shuffled, not periodic


def test_blend_is_deterministic_from_the_seed_and_resumes_at_the_exact_sample():
    def blend(seed):
        return BlendedSamples([Source(0), Source(1)], [0.5, 0.5], seed)

    def read(samples, ks):
        return [samples[k].tolist() for k in ks]

    first = read(blend(1), range(5000))
    # The same seed: the same samples from another object read backwards (no state carried from earlier reads), and
    # from a fresh object per read (a strided sample: 5,000 fresh objects took 4 s and showed nothing more).
    assert read(blend(1), reversed(range(5000))) == first[::-1]
    assert [read(blend(1), [k])[0] for k in range(0, 5000, 97)] == first[::97]
    assert first != read(blend(2), range(5000))
    members = [PackedSamples(torch.arange(5000) + 100_000 * d, 8, seed=3) for d in range(2)]
    samples = BlendedSamples(members, [0.25, 0.75], seed=3)
    full = MicroBatchStream(samples, 2, 3, dp_rank=1, dp_size=2)
    seen = [next(full) for _ in range(3 * 6)]
    resumed = MicroBatchStream(BlendedSamples(members, [0.25, 0.75], seed=3), 2, 3, 1, 2, start_step=4)
    assert all(torch.equal(next(resumed)[0], x) for x, _ in seen[12:])


def blend_config(tmp_path, blend, **model):
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["model"].update(seq_length=32, **model)
    cfg["ds_megatron"]["data"] = {"blend": blend, "cache_dir": str(tmp_path / "cache")}
    return cfg


@pytest.mark.parametrize(
    "blend,expected",
    [
        ([["a", -1], ["b", 1]], "error: ds_megatron.data.blend: weights must be finite and >= 0 (a: -1)"),
        ([["a", 0], ["b", 0.0]], "error: ds_megatron.data.blend: all weights are zero (a: 0, b: 0.0)"),
        ([["a", 1, 2]], "error: ds_megatron.data.blend: entry 0 is not [prepared directory, weight]"),
        (["a"], "error: ds_megatron.data.blend: entry 0 is not [prepared directory, weight]"),
        ([["a", "heavy"]], "error: ds_megatron.data.blend: entry 0 is not [prepared directory, weight]"),
    ],
)
def test_bad_weights_are_one_config_error(tmp_path, blend, expected):
    with pytest.raises(ConfigError) as err:
        resolve(blend_config(tmp_path, blend), 1)
    assert str(err.value).startswith(expected) and ";" in str(err.value)


def test_blend_and_path_together_are_refused(tmp_path):
    cfg = blend_config(tmp_path, [["a", 1]])
    cfg["ds_megatron"]["data"]["path"] = "x.jsonl"
    with pytest.raises(ConfigError, match="set together with data.path"):
        resolve(cfg, 1)


@pytest.fixture(scope="module")
def two_prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blend")
    tok = make_tokenizer(tmp / "tok")
    a = run_prepare(write_corpus(tmp / "ca", docs=10), tok, tmp / "a", progress=False)
    b = run_prepare(write_corpus(tmp / "cb", "txt", docs=30), tok, tmp / "b", progress=False)
    assert a["tokenizer"]["fingerprint"] == b["tokenizer"]["fingerprint"]
    return tmp


def test_training_reads_a_blend(tmp_path, two_prepared, capsys):
    blend = [[str(two_prepared / "a"), 3], [str(two_prepared / "b"), 1]]
    cfg = blend_config(tmp_path, blend)
    cfg["ds_megatron"]["data"]["valid_fraction"] = 0.1
    run = resolve(cfg, 1)
    check_data(run)
    data = prepare_data(run, 0, tmp_path / "run")
    out, err = capsys.readouterr()
    assert "data: blend of 2 prepared directories" in out and "0.7500 (weight 0.7500)" in out
    a, b = two_prepared / "a", two_prepared / "b"  # prepared with the default 0.02: the run's 0.1 does nothing
    assert f"valid_fraction=0.1 is ignored: {a} was prepared with 0.02, {b} was prepared with 0.02 (" in err
    sources = [data.train.locate(k)[0] for k in range(8192)]
    assert sources.count(0) == 6144 and data.train[0].shape == (33,)
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    assert isinstance(data.valid, BlendedSamples) and data.valid[3].shape == (33,)


def test_blends_of_different_tokenizers_or_unprepared_directories_are_refused(tmp_path, two_prepared):
    other = make_tokenizer(tmp_path / "words", words=500)
    run_prepare(write_corpus(tmp_path / "c", docs=10), other, tmp_path / "w", progress=False)
    blend = [[str(two_prepared / "a"), 1], [str(tmp_path / "w"), 1]]
    with pytest.raises(ConfigError, match="ds_megatron.data.blend: the directories were tokenised with different"):
        check_data(resolve(blend_config(tmp_path, blend), 1))
    with pytest.raises(ConfigError, match=r"ds_megatron.data.blend: not a prepared directory \(.*/c has no manifest"):
        check_data(resolve(blend_config(tmp_path, [[str(two_prepared / "a"), 1], [str(tmp_path / "c"), 1]]), 1))
    broken = shutil.copytree(two_prepared / "b", tmp_path / "b")
    (broken / "shard_00000.idx").unlink()
    with pytest.raises(ConfigError, match="does not match its manifest .*shard_00000.idx is missing"):
        check_data(resolve(blend_config(tmp_path, [[str(two_prepared / "a"), 1], [str(broken), 1]]), 1))


def test_recipe_refuses_a_blend_of_two_tokenizers_in_one_line(tmp_path, two_prepared):
    other = make_tokenizer(tmp_path / "words", words=500)
    run_prepare(write_corpus(tmp_path / "c", docs=10), other, tmp_path / "w", progress=False)
    blend = json.dumps([[str(two_prepared / "a"), 1], [str(tmp_path / "w"), 1]])
    args = ["--set", f"ds_megatron.data.blend={blend}", "--set", "ds_megatron.model.seq_length=32"]
    proc = recipe([*args, "--save", str(tmp_path / "save")])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ds_megatron.data.blend: the directories were tokenised with different")
    assert not (tmp_path / "save").exists()


def test_a_blend_is_set_on_the_command_line_with_set(tmp_path, two_prepared, monkeypatch, capsys):
    from ds_megatron.cli.train import build_parser, validate

    monkeypatch.setenv("WORLD_SIZE", "4")
    a, b = str(two_prepared / "a"), str(two_prepared / "b")
    base = ["--deepspeed_config", str(TINY), "--set", "ds_megatron.model.seq_length=32", "--set"]
    _, run = validate([*base, f"ds_megatron.data.blend={json.dumps([[a, 0.7], [b, 0.3]])}"])
    assert [list(entry) for entry in run.section.data.blend] == [[a, 0.7], [b, 0.3]] and run.section.data.path is None
    with pytest.raises(ConfigError) as err:  # the shell ate the inner quotes
        validate([*base, f"ds_megatron.data.blend=[[{a},0.7]]"])
    line = str(err.value)
    assert line.startswith("error: --set ds_megatron.data.blend: not valid JSON (Expecting value at character 2 of ")
    assert line.endswith("""--set 'ds_megatron.data.blend=[["web.prepared", 0.7], ["code.prepared", 0.3]]'""")
    assert validate([*base, "ds_megatron.train.prompt=plain text"])[1].section.train.prompt == "plain text"
    help_text = " ".join(build_parser().format_help().split())
    assert """--set 'ds_megatron.data.blend=[["web.prepared", 0.7], ["code.prepared", 0.3]]'""" in help_text
