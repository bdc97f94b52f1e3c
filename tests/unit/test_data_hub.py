"""Hugging Face dataset names that cannot be had (no network, no such dataset, a configuration name missing or wrong)
are one line and exit status 2 in pre-flight, quickly, with the way to local files, a prepared directory or the
configuration name (``data.hf_config``); never a traceback from every rank.  A dataset with several configurations
resolves, and loads, with ``data.hf_config``.  The Hub is never contacted: HF_HUB_OFFLINE=1 with a cache of our own
(metadata, and for loading the Arrow file ``datasets`` would have downloaded), or an endpoint on a closed local
port."""

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


def cache_dataset(hf_home: Path, name: str, configs: dict[str, list[str]], rows: dict | None = None) -> None:
    """What ``datasets`` leaves in its cache after loading ``name`` once per configuration (its metadata: columns of
    text, one "train" split), as the offline lookup finds it; with ``rows`` ({config: [record, ...]}) also the train
    split's Arrow file, which an offline ``load_dataset`` reads."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    for config, columns in configs.items():
        where = hf_home / "datasets" / name.replace("/", "___") / config / "0.0.0" / "0"
        where.mkdir(parents=True)
        records = (rows or {}).get(config, [])
        features = datasets.Features({c: datasets.Value("string") for c in columns})
        datasets.DatasetInfo(
            features=features,
            config_name=config,
            splits=datasets.SplitDict({"train": datasets.SplitInfo("train", num_examples=max(1, len(records)))}),
        ).write_to_directory(str(where))
        if records:
            with ArrowWriter(path=str(where / f"{name.split('/')[-1]}-train.arrow"), features=features) as writer:
                for record in records:
                    writer.write(record)
                writer.finalize()


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
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if case == "needs a configuration":
        assert lines[0] == (
            "error: ds_megatron.data.hf_config: the Hugging Face dataset needs a configuration name ('wikitext' has "
            "wikitext-2-raw-v1, wikitext-103-raw-v1); set data.hf_config to one of them "
            "(--set ds_megatron.data.hf_config=wikitext-2-raw-v1)"
        )
    else:
        assert lines[0].startswith(f"error: ds_megatron.data.path: {expected}"), lines[0]
        assert f"--data {name.split('/')[-1]}.jsonl" in lines[0] and "python -m ds_megatron.data prepare" in lines[0]
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


def test_only_the_first_process_of_a_node_asks_the_hub(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(hub, "check_hub_dataset", lambda *args: asked.append(args))
    for local_rank in ("0", "1", "7"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        check_data(hub_run(tmp_path, "wikitext", hf_config="wikitext-103-raw-v1"))
    assert asked == [("wikitext", "wikitext-103-raw-v1", "train", "text")]


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
    found = hub.describe_failure("wikitxt", None, "train", err, offline=False)
    assert found.setting == "ds_megatron.data.path"
    assert found.problem == "no local file of that name, and no such Hugging Face dataset"
    assert found.values == "'wikitxt': Dataset 'wikitxt' doesn't exist on the Hub or cannot be accessed."
    assert found.fix.startswith("check the path, or the name on https://huggingface.co/datasets; or save it as local")


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
    assert str(hub.describe_failure("wikitext", None, "train", err, offline=False)) == (
        "error: ds_megatron.data.hf_config: the Hugging Face dataset needs a configuration name ('wikitext' has "
        "wikitext-103-raw-v1, wikitext-2-raw-v1); set data.hf_config to one of them "
        "(--set ds_megatron.data.hf_config=wikitext-103-raw-v1)"
    )
    wrong = ValueError("BuilderConfig 'wikitext-3' not found. Available: ['wikitext-103-raw-v1', 'wikitext-2-raw-v1']")
    assert str(hub.describe_failure("wikitext", "wikitext-3", "train", wrong, offline=False)) == (
        "error: ds_megatron.data.hf_config: the Hugging Face dataset has no such configuration ('wikitext-3'; "
        "'wikitext' has wikitext-103-raw-v1, wikitext-2-raw-v1); set data.hf_config to one of them "
        "(--set ds_megatron.data.hf_config=wikitext-103-raw-v1)"
    )


WIKITEXT = {"wikitext-103-raw-v1": ["text"], "wikitext-2-raw-v1": ["text"]}


def test_a_dataset_with_configurations_passes_pre_flight_with_hf_config(tmp_path, offline_cache):
    cache_dataset(offline_cache, "wikitext", WIKITEXT)
    check_data(hub_run(tmp_path, "wikitext", hf_config="wikitext-103-raw-v1"))
    with pytest.raises(ConfigError) as err:
        check_data(hub_run(tmp_path, "wikitext", hf_config="wikitext-3"))
    assert str(err.value) == (
        "error: ds_megatron.data.hf_config: the Hugging Face dataset has no such configuration ('wikitext-3'; "
        "'wikitext' has wikitext-103-raw-v1, wikitext-2-raw-v1); set data.hf_config to one of them "
        "(--set ds_megatron.data.hf_config=wikitext-103-raw-v1)"
    )
    with pytest.raises(ConfigError) as err:
        check_data(hub_run(tmp_path, "wikitext", hf_config="wikitext-2-raw-v1", split="test"))
    assert str(err.value) == (
        "error: ds_megatron.data.split: the Hugging Face dataset has no such split ('test'; 'wikitext' "
        "(wikitext-2-raw-v1) has train); set data.split to one of them"
    )


def test_the_in_launch_loader_reads_the_configuration_asked_for(tmp_path, offline_cache):
    """A real ``datasets.load_dataset(path, name=hf_config)``, from the offline cache: each configuration its own
    text, and the launch's cache key tells them apart."""
    from ds_megatron.data.corpus import inputs_key

    rows = {c: [{"text": f"a document of {c}"}, {"text": "another"}] for c in WIKITEXT}
    cache_dataset(offline_cache, "wikitext", WIKITEXT, rows)
    for config in WIKITEXT:
        ds = corpus.load_documents("wikitext", hf_config=config)
        assert ds["text"] == [f"a document of {config}", "another"]
    keys = {inputs_key(hub_run(tmp_path, "wikitext", hf_config=c)) for c in WIKITEXT}
    assert len(keys) == 2 and inputs_key(hub_run(tmp_path, "wikitext")) not in keys


@pytest.mark.parametrize("where", ["local file", "built-in corpus", "blend"])
def test_hf_config_is_refused_without_a_hub_name(tmp_path, where):
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    path, extra = {
        "local file": (str(tmp_path / "a.jsonl"), {}),
        "built-in corpus": (None, {}),
        "blend": (None, {"blend": [["a.prepared", 1]]}),
    }[where]
    with pytest.raises(ConfigError) as err:  # the configuration alone, or with files: pre-flight
        check_data(hub_run(tmp_path, path, **extra, hf_config="wikitext-2-raw-v1"))
    shown = {
        "local file": f"path={str(tmp_path / 'a.jsonl')!r}",
        "built-in corpus": "path=None",
        "blend": "blend=[['a.prepared', 1]]",
    }[where]
    assert str(err.value) == (
        "error: ds_megatron.data.hf_config: a configuration name needs a Hugging Face dataset name in data.path "
        f"(hf_config='wikitext-2-raw-v1', {shown}); remove data.hf_config, or set data.path to the dataset's name "
        "(e.g. wikitext)"
    )
