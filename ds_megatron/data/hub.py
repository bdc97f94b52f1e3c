"""Hugging Face dataset names (a ``data.path`` that is neither local files nor a prepared directory, with its
configuration name in ``data.hf_config`` where it has several), resolved before any process group exists.

Loaded in the launch, a dataset that cannot be had (no network, a wrong name, a configuration name missing or wrong)
fails on every rank with a ``ConnectionError`` or ``ValueError`` traceback, after ``datasets`` has retried an
unreachable Hub for about 25 s.  ``check_hub_dataset`` asks for the dataset's metadata only (the Hub, or the local
cache with ``HF_HUB_OFFLINE=1``), in pre-flight, and turns every failure into one :class:`ConfigError` line that says
which ``data.hf_config`` to set, or how to train from local files or a prepared directory instead.
``describe_failure`` is the one place that maps ``datasets``' exceptions to that line; the in-launch loader uses it
too.
"""

from __future__ import annotations

import ast
import re
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from ds_megatron.config import ConfigError

SETTING = "ds_megatron.data.path"
CONFIG_SETTING = "ds_megatron.data.hf_config"
# A TCP connection to the Hub says within this many seconds what datasets' own retries (5, with back-off) take about
# 25 s to conclude when the network is down.
PROBE_TIMEOUT_S = 5.0


def local_fix(name: str, split: str, config: str | None = None) -> str:
    """How to train on the dataset without the Hub in the launch: save it as JSON lines, pass the file or prepare it."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", config or name.rsplit("/", 1)[-1])
    args = ", ".join(repr(a) for a in (name, config) if a is not None)
    save = f"datasets.load_dataset({args}, split={split!r}).to_json('{stem}.jsonl')"
    return (
        f'save it as local files where there is a network (python -c "import datasets; {save}") and pass '
        f"--data {stem}.jsonl, or a directory made from them by `python -m ds_megatron.data prepare --data "
        f"{stem}.jsonl ...`"
    )


def _config_names(message: str) -> list[str]:
    """The configurations ``datasets`` lists when a name alone is ambiguous or the configuration name is wrong (from
    the Hub: "available configs: [...]", "Available: [...]"; from the cache: "Available configs in the cache: [...]",
    "configurations in the cache: a, b")."""
    listed = re.search(r"[Aa]vailable(?: configs)?(?: in the cache)?: (\[.*?\])", message)
    if listed:
        return [str(c) for c in ast.literal_eval(listed.group(1))]
    cached = re.search(r"configurations in the cache: ([^\n]+)", message)
    return [c.strip() for c in cached.group(1).split(",")] if cached else []


def named(name: str, config: str | None) -> str:
    """A dataset as the error lines name it: 'wikitext', or 'wikitext' (wikitext-103-raw-v1)."""
    return f"{name!r}" if config is None else f"{name!r} ({config})"


def describe_failure(name: str, config: str | None, split: str, err: Exception, offline: bool) -> ConfigError:
    """The one-line error for an exception ``datasets`` raised while resolving ``name`` (configuration ``config``)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    configs = _config_names(text)
    fix = local_fix(name, split, config)
    if configs:
        listed = f"{name!r} has {', '.join(configs)}"
        choose = f"set data.hf_config to one of them (--set {CONFIG_SETTING}={configs[0]})"
        if config is None:
            return ConfigError(CONFIG_SETTING, "the Hugging Face dataset needs a configuration name", listed, choose)
        wrong = f"{config!r}; {listed}"
        return ConfigError(CONFIG_SETTING, "the Hugging Face dataset has no such configuration", wrong, choose)
    if isinstance(err, ConnectionError) and offline:  # datasets' OfflineModeIsEnabled, once the cache had nothing
        import datasets

        return ConfigError(
            SETTING,
            "no local file of that name, and no Hugging Face dataset of that name in the local cache (the Hub is off: "
            "HF_HUB_OFFLINE=1)",
            f"{named(name, config)}; cache {datasets.config.HF_DATASETS_CACHE}",
            fix,
        )
    if isinstance(err, ConnectionError):
        return ConfigError(
            SETTING, "cannot reach the Hugging Face Hub for this dataset", f"{named(name, config)}: {first}", fix
        )
    if isinstance(err, FileNotFoundError):  # also datasets' DatasetNotFoundError
        return ConfigError(
            SETTING,
            "no local file of that name, and no such Hugging Face dataset",
            f"{named(name, config)}: {first}",
            f"check the path, or the name on https://huggingface.co/datasets; or {fix}",
        )
    values = f"{named(name, config)}: {type(err).__name__}: {first}"
    return ConfigError(SETTING, "cannot load the Hugging Face dataset", values, fix)


def hub_unreachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a TCP connection to the Hub's host, or to the proxy the environment names for it, fails (None: it
    succeeds)."""
    url = urllib.parse.urlsplit(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    via = ""
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url, via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}"), f"proxy {proxy}: "
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return None
    except OSError as err:
        return via + (str(err) or type(err).__name__)


@contextmanager
def _quiet() -> Iterator[None]:
    """No warnings from datasets or huggingface_hub while resolving: the outcome is one line of ours."""
    import datasets
    import huggingface_hub.utils.logging as hub_logging

    levels = datasets.logging.get_verbosity(), hub_logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(levels[0])
        hub_logging.set_verbosity(levels[1])


def check_hub_dataset(name: str, config: str | None, split: str, text_field: str) -> None:
    """The dataset resolves with configuration ``config`` (Hub metadata, or the local cache when offline) and, where
    its metadata lists them, has ``split`` and ``text_field``; ConfigError otherwise.  Downloads no data files."""
    import datasets
    from huggingface_hub import constants

    offline = bool(datasets.config.HF_HUB_OFFLINE)
    if not offline:
        why = hub_unreachable(constants.ENDPOINT)
        if why is not None:
            raise ConfigError(
                SETTING,
                "no local file of that name, and the Hugging Face Hub cannot be reached for a dataset of that name",
                f"{named(name, config)}; {constants.ENDPOINT}: {why}",
                f"{local_fix(name, split, config)}; with a copy in the local Hugging Face cache, set HF_HUB_OFFLINE=1",
            )
    with _quiet():
        try:
            builder = datasets.load_dataset_builder(name, name=config)
        except Exception as err:  # every failure of the lookup becomes the one line
            raise describe_failure(name, config, split, err, offline) from None
    splits = builder.info.splits
    if splits and split not in splits:
        raise ConfigError(
            "ds_megatron.data.split",
            "the Hugging Face dataset has no such split",
            f"{split!r}; {named(name, config)} has {', '.join(splits)}",
            "set data.split to one of them",
        )
    features = builder.info.features
    if features and text_field not in features:
        raise ConfigError(
            "ds_megatron.data.text_field",
            "the Hugging Face dataset has no such column",
            f"{text_field!r}; {named(name, config)} has {', '.join(features)}",
            "set data.text_field to the column that holds the text",
        )
