"""Hugging Face dataset names that cannot be had (no network, no such dataset, a configuration name needed) are one
line and exit status 2 in pre-flight, quickly, with the way to local files or a prepared directory; never a
traceback from every rank.  The Hub is never contacted: HF_HUB_OFFLINE=1 with a cache of our own, or an endpoint on
a closed local port."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from launch import _free_port
from test_data_training import TINY, recipe

from ds_megatron.config import ConfigError, resolve
from ds_megatron.data import corpus, hub
from ds_megatron.preflight import check_data

# datasets sleeps 23 s between its retries of an unreachable Hub; pre-flight must answer well within that.
QUICK_S = 10
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def cache_dataset(hf_home: Path, name: str, configs: dict[str, list[str]]) -> None:
    """What ``datasets`` leaves in its cache after loading ``name`` once per configuration (its metadata: columns of
    text, one "train" split), as the offline lookup finds it."""
    import datasets

    for config, columns in configs.items():
        where = hf_home / "datasets" / name.replace("/", "___") / config / "0.0.0" / "0"
        where.mkdir(parents=True)
        datasets.DatasetInfo(
            features=datasets.Features({c: datasets.Value("string") for c in columns}),
            config_name=config,
            splits=datasets.SplitDict({"train": datasets.SplitInfo("train", num_examples=1)}),
        ).write_to_directory(str(where))


@pytest.mark.parametrize("case", ["not cached", "needs a configuration", "unreachable"])
def test_a_hub_name_that_cannot_be_had_is_one_line_before_any_process_group(tmp_path, case):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    name, expected = "someone/no-such-corpus", "no local file of that name, and no Hugging Face dataset of that name"
    if case == "needs a configuration":
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}  # datasets' own name for offline works too
        cache_dataset(tmp_path / "hf", "wikitext", {"wikitext-103-raw-v1": ["text"], "wikitext-2-raw-v1": ["text"]})
        name, expected = "wikitext", "the Hugging Face dataset needs a configuration name"
    elif case == "unreachable":
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{_free_port()}"}
        name, expected = "wikitext", "no local file of that name, and the Hugging Face Hub cannot be reached"
    proc = recipe(["--data", name, "--save", str(tmp_path / "save")], env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: ds_megatron.data.path: {expected}"), lines[0]
    assert f"--data {'wikitext-2-raw-v1' if case == 'needs a configuration' else name.split('/')[-1]}.jsonl" in lines[0]
    assert "python -m ds_megatron.data prepare" in lines[0] and "Traceback" not in proc.stderr
    if case == "needs a configuration":
        assert "'wikitext' has wikitext-2-raw-v1, wikitext-103-raw-v1" in lines[0]
        assert "datasets.load_dataset('wikitext', 'wikitext-2-raw-v1', split='train')" in lines[0]
    assert not (tmp_path / "save").exists()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """This process's datasets, offline, reading a cache of its own."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    return tmp_path / "hf"


def hub_run(tmp_path: Path, name: str, **data):
    cfg = json.loads(TINY.read_text())
    cfg["ds_megatron"]["parallel"] = {"tp": 1, "pp": 1}
    cfg["ds_megatron"]["data"] = {"path": name, "cache_dir": str(tmp_path / "cache"), **data}
    return resolve(cfg, 1)


def test_an_unreachable_hub_is_refused_in_seconds_not_after_retries(tmp_path, monkeypatch):
    import datasets
    from huggingface_hub import constants

    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"the Hugging Face Hub cannot be reached .*Connection refused"):
        check_data(hub_run(tmp_path, "wikitext"))
    assert time.perf_counter() - start < QUICK_S


def test_a_cached_dataset_passes_and_its_split_and_column_are_checked(tmp_path, offline_cache):
    cache_dataset(offline_cache, "owner/tiny", {"plain": ["body"]})
    check_data(hub_run(tmp_path, "owner/tiny", text_field="body"))
    with pytest.raises(ConfigError, match=r"^error: ds_megatron.data.split: .* \('test'; 'owner/tiny' has train\)"):
        check_data(hub_run(tmp_path, "owner/tiny", text_field="body", split="test"))
    with pytest.raises(ConfigError, match=r"^error: ds_megatron.data.text_field: .* \('text'; 'owner/tiny' has body\)"):
        check_data(hub_run(tmp_path, "owner/tiny"))


def test_the_in_launch_loader_fails_in_the_same_one_line(offline_cache):
    with pytest.raises(ConfigError) as err:
        corpus.load_documents("someone/no-such-corpus")
    line = str(err.value)
    assert line.startswith("error: ds_megatron.data.path: no local file of that name, and no Hugging Face dataset")
    assert "--data no-such-corpus.jsonl" in line and "\n" not in line


def test_a_wrong_name_on_a_reachable_hub_says_to_check_it():
    from datasets.exceptions import DatasetNotFoundError

    err = DatasetNotFoundError("Dataset 'wikitxt' doesn't exist on the Hub or cannot be accessed.")
    problem, values, fix = hub.describe_failure("wikitxt", "train", err, offline=False)
    assert problem == "no local file of that name, and no such Hugging Face dataset"
    assert values == "'wikitxt': Dataset 'wikitxt' doesn't exist on the Hub or cannot be accessed."
    assert fix.startswith("check the path, or the name on https://huggingface.co/datasets; or save it as local files")


def test_the_probe_connects_to_the_hub_or_to_the_proxy_named_for_it(monkeypatch):
    import socket

    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = f"http://127.0.0.1:{server.getsockname()[1]}"
        closed = f"http://127.0.0.1:{_free_port()}"
        assert hub.hub_unreachable(listening) is None
        assert "refused" in hub.hub_unreachable(closed)
        monkeypatch.setenv("HTTPS_PROXY", closed)  # a cluster that reaches the Hub only through a proxy
        assert hub.hub_unreachable("https://hub.example").startswith(f"proxy {closed}: ")
        monkeypatch.setenv("HTTPS_PROXY", listening)
        assert hub.hub_unreachable("https://hub.example") is None


def test_a_configuration_name_listed_by_the_hub_is_named_too():
    err = ValueError(
        "Config name is missing.\nPlease pick one among the available configs: ['wikitext-103-raw-v1', "
        "'wikitext-2-raw-v1']\nExample of usage:\n\t`load_dataset('wikitext', 'wikitext-103-raw-v1')`"
    )
    problem, values, fix = hub.describe_failure("wikitext", "train", err, offline=False)
    assert problem == "the Hugging Face dataset needs a configuration name, which data.path cannot carry"
    assert values == "'wikitext' has wikitext-103-raw-v1, wikitext-2-raw-v1"
    assert "datasets.load_dataset('wikitext', 'wikitext-103-raw-v1', split='train')" in fix
