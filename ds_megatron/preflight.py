"""Every check of a run that needs files but no process group: data files, tokenizer size, ``--init-from-hf`` and
``--load`` compatibility.  ``config.resolve`` checks the configuration itself (shapes, layout, batch, optimizer,
schedule); together they are the pre-flight the recipe runs on every rank before anything distributed starts, so a
bad input costs one line (:class:`ConfigError`) and nothing is created.

Heavy imports (transformers, safetensors) happen only when a check needs them.
"""

from __future__ import annotations

import os
from pathlib import Path

from ds_megatron.config import ConfigError, RunConfig, check_text_settings, effective_tokenizer, resolve
from ds_megatron.config.facts import layout_text, needs_resharding, precision, saved_world
from ds_megatron.config.rules import CONFIG_FILE_RULES, check_tokenizer_fits, check_valid_fraction
from ds_megatron.config.shape import SHAPE_FIELDS

# What a checkpoint's weights depend on (and the sequence length it trained at): a resumed run must match each, or
# loading would fail deep inside DeepSpeed (another family, KV width or MLP width, a tied or untied output layer).
# A mixture of experts' weights also depend on its head width, its experts and which layers have them (the top-k,
# the renormalisation and the losses' weights do not).
EXPERT_KEYS = ("head_dim", "num_experts", "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step")
SHAPE_KEYS = ("family", *SHAPE_FIELDS, *EXPERT_KEYS, "vocab_size", "seq_length", "max_position_embeddings")


def check_run(run: RunConfig) -> None:
    """All file-level checks of a resolved run."""
    from ds_megatron.data.megatron_indexed import megatron_prefix
    from ds_megatron.data.prepared import reads_prepared

    check_data(run)
    data = run.section.data
    # prepared data brings its own tokenizer, and Megatron data's is checked against its ids: both by check_data
    if not reads_prepared(data) and megatron_prefix(data.path) is None:
        check_tokenizer_files(run)
    init = run.section.checkpoint.init_from_hf
    if init is not None:
        check_init_from_hf(run, Path(init))
    load = run.section.checkpoint.load
    if load is not None:
        check_resume(run, Path(load))


def check_data(run: RunConfig) -> None:
    """Prepared directories (``data.path`` or ``data.blend``) are complete and match their manifests; a Megatron
    indexed pair (``data.path`` or in ``data.blend``) is well formed and its ids fit the tokenizer; local text
    exists, is not empty and is small enough to tokenise inside the launch (``data.max_inlaunch_bytes``); a Hugging
    Face dataset name resolves, with its configuration ``data.hf_config`` (``data.hub``: metadata only, the Hub or the
    local cache), and only a dataset name has one."""
    data = run.section.data
    if data.blend:
        check_blend(run)
        return
    if data.path is None:
        return
    from ds_megatron.config.loader import hf_config_unused
    from ds_megatron.data.corpus import check_some_text, is_local, matching_files, resolve_files
    from ds_megatron.data.megatron_indexed import megatron_prefix
    from ds_megatron.data.prepared import is_prepared

    megatron = megatron_prefix(data.path)
    if data.hf_config is not None and (is_local(data.path) or megatron is not None):
        raise hf_config_unused(data)
    if is_prepared(data.path):
        check_prepared_dir(run, data.path, "ds_megatron.data.path")
        return
    if megatron is not None:
        from ds_megatron.data.megatron_indexed import tokenizer_spec

        spec = tokenizer_spec(data.tokenizer, None, "ds_megatron.data.tokenizer")
        vocab = check_tokenizer_files(run)  # and data.valid_fraction, which cuts this data as it cuts text
        ds = check_megatron_files(run, megatron, "ds_megatron.data.path")
        check_megatron_ids(run, ds, vocab, spec)
        check_megatron_documents(run, ds, spec)
        return
    if is_local(data.path):
        if os.path.isdir(os.path.expanduser(data.path)) and not resolve_files(data.path):
            raise ConfigError(
                "ds_megatron.data.path",
                "a directory with neither a prepared manifest nor text files",
                f"{data.path} has no manifest.json and no .txt/.json/.jsonl/.parquet file",
                "pass a directory written by `python -m ds_megatron.data prepare`, or text files",
            )
        files = matching_files(data.path, "ds_megatron.data.path")
        check_some_text(files, "ds_megatron.data.path")
        check_inlaunch_size(run, files)
        check_text_encoding(run, files)
        return
    from ds_megatron.data.hub import check_hub_dataset

    # One question to the Hub per node, not per rank (a thousand ranks asking at once meet its rate limit): a failure
    # exits the node's first process, and the launcher stops the others with it.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        check_hub_dataset(data.path, data.hf_config, data.split, data.text_field)


def prepare_command(run: RunConfig, files: list[str]) -> tuple[str, str]:
    """The ``python -m ds_megatron.data prepare`` command for this run's text, and the directory it writes."""
    import shlex

    data = run.section.data
    common = os.path.commonpath([os.path.abspath(f) for f in files])
    out = (os.path.splitext(common)[0] if os.path.isfile(common) else common.rstrip("/")) + ".prepared"
    argv = ["python", "-m", "ds_megatron.data", "prepare", "--data", data.path, "--tokenizer", effective_tokenizer(run)]
    argv += ["--out", out]
    if data.text_field != "text":
        argv += ["--text-field", data.text_field]
    if data.valid_fraction != 0.02:
        argv += ["--valid-fraction", str(data.valid_fraction)]
    return shlex.join(argv), out


def check_inlaunch_size(run: RunConfig, files: list[str]) -> None:
    """Tokenising inside the launch holds every rank back while it runs: above the limit, prepare beforehand."""
    limit = run.section.data.max_inlaunch_bytes
    total = sum(os.path.getsize(f) for f in files)
    if total > limit:
        command, out = prepare_command(run, files)
        raise ConfigError(
            "ds_megatron.data.path",
            "too much text to tokenise inside the training launch",
            f"{total / 1e9:.2f} GB in {len(files)} file(s) > data.max_inlaunch_bytes {limit / 1e9:.2f} GB",
            f"prepare it first with `{command}`, then pass --data {out}",
        )


def check_text_encoding(run: RunConfig, files: list[str]) -> None:
    """Local text the launch will tokenise is UTF-8 (datasets' readers stop at a bad byte with a traceback, after the
    run directory exists).  Read by one process per node (a failure exits it, and the launcher stops the others),
    at most data.max_inlaunch_bytes (checked before), and only when the launch will read the text: a packed cache
    already built from these very files (names, sizes and times in its launch record) means they decoded then."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from ds_megatron.data.corpus import launch_record
    from ds_megatron.data.sources import UTF8_SUFFIXES, check_utf8_file

    if launch_record(run).is_file():
        return
    for f in files:
        if os.path.splitext(f)[1] in UTF8_SUFFIXES:
            check_utf8_file(f, "ds_megatron.data.path")


def check_prepared_dir(run: RunConfig, directory: str, setting: str) -> dict:
    """A complete prepared directory whose files match the manifest (sha256 too with ``data.verify_checksums``, read by
    one process per node), a tokenizer that fits the model and enough tokens for a sample in both splits."""
    from ds_megatron.data.prepared import check_prepared, read_manifest

    checksums = run.section.data.verify_checksums and os.environ.get("LOCAL_RANK", "0") == "0"
    problem = check_prepared(directory, checksums)
    if problem is not None:
        raise ConfigError(setting, *problem)
    manifest = read_manifest(directory)
    size = manifest["tokenizer"]["vocab_size"]
    problem = "the prepared directory's tokenizer is larger than the model's vocabulary"
    check_tokenizer_fits(
        size, f"{size} tokens in {directory}", run.model.vocab_size, CONFIG_FILE_RULES, setting, problem
    )
    check_split_sizes(run, setting, manifest["num_tokens"], manifest["valid_fraction"], directory)
    return manifest


def check_split_sizes(run: RunConfig, setting: str, total: int, fraction: float, where: str) -> None:
    """Both splits (``split_train_valid``'s cut) hold at least one sample of seq_length + 1 tokens."""
    valid = total - int(total * (1.0 - fraction))
    if min(valid, total - valid) <= run.model.seq_length:
        raise ConfigError(
            setting,
            "too few tokens for one sample of seq_length + 1 in each split",
            f"{total} tokens in {where}, {valid} of them for validation, seq_length {run.model.seq_length}",
            "use more text (or a larger valid fraction), or lower seq_length",
        )


def check_megatron_files(run: RunConfig, prefix: str, setting: str):
    """A Megatron indexed pair that passes ``open_indexed`` and holds enough tokens for a sample in each split of
    ``data.valid_fraction``; returns it opened."""
    from ds_megatron.data.megatron_indexed import open_indexed

    check_valid_fraction(run.section.data.valid_fraction, CONFIG_FILE_RULES)
    ds = open_indexed(prefix)
    check_split_sizes(run, setting, len(ds.tokens), run.section.data.valid_fraction, prefix)
    return ds


def check_megatron_ids(run: RunConfig, ds, vocab: int, spec: str) -> None:
    """No id of the pair ``ds`` is negative or missing from the tokenizer ``spec`` (``vocab`` tokens).  Scanned by
    one process per node (a failure exits it, and the launcher stops the others), a sequential read of the ids, and
    recorded in ``data.cache_dir`` for these files' sizes and
    times, so a later launch on the unchanged pair skips the scan."""
    from ds_megatron.data.megatron_indexed import record_ids, recorded_ids, scan_ids

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    cache_dir = run.section.data.cache_dir
    found = recorded_ids(ds, cache_dir)
    max_id, min_id = found if found is not None else scan_ids(ds.tokens)
    bin_file = f"{ds.prefix}.bin"
    if min_id is not None:
        raise ConfigError(
            bin_file, "negative token ids", f"smallest {min_id}", "rebuild the pair with non-negative token ids"
        )
    if max_id >= vocab:
        raise ConfigError(
            "ds_megatron.data.tokenizer",
            "the tokenizer is smaller than the largest token id in the data",
            f"{vocab} tokens in {spec}, id {max_id} in {bin_file}",
            "pass the tokenizer the data was tokenised with",
        )
    if found is None:
        record_ids(ds, cache_dir, max_id)


def check_megatron_documents(run: RunConfig, ds, spec: str, tok=None) -> None:
    """With ``data.document_mask``, the pair's documents end in the tokenizer's EOS, which is how a packed window's
    documents are found: a pair written without EOS would train with nothing masked, silently.  Refused when fewer
    than half of a sample of its documents (``documents_ending_in``) end in EOS."""
    if not run.section.data.document_mask:
        return
    from ds_megatron.data.corpus import eos_id
    from ds_megatron.data.megatron_indexed import documents_ending_in

    eos = eos_id(tok if tok is not None else load_fitting_tokenizer(run, spec))
    ended, looked = documents_ending_in(ds, eos)
    if looked and 2 * ended < looked:
        raise ConfigError(
            "ds_megatron.data.document_mask",
            "the Megatron data's documents do not end in EOS, which is how packed documents are told apart",
            f"{ended} of {looked} documents sampled from {ds.prefix}.idx end in EOS id {eos}",
            "rewrite the pair with an EOS after every document (Megatron's preprocess_data.py --append-eod) "
            "or set data.document_mask false",
        )


def check_blend(run: RunConfig) -> None:
    """Every blended prepared directory passes ``check_prepared_dir`` and every Megatron prefix
    ``check_megatron_files``; all were made with one tokenizer (the prepared directories' fingerprints agree, and a
    ``data.tokenizer`` given for the Megatron data is theirs too), whose size covers every Megatron id."""
    from ds_megatron.data.megatron_indexed import megatron_prefix, tokenizer_spec
    from ds_megatron.data.prepared import TOKENIZER_DIR, check_one_tokenizer, is_prepared

    setting = "ds_megatron.data.blend"
    fingerprints, megatron = {}, []
    for directory, _ in run.section.data.blend:
        prefix = None if is_prepared(directory) else megatron_prefix(directory, setting)  # as for data.path
        if prefix is not None:
            megatron.append(check_megatron_files(run, prefix, setting))
            continue
        if not is_prepared(directory):
            raise ConfigError(
                setting,
                "not a prepared directory",
                f"{directory} has no manifest.json written by prepare, and no {directory}.bin/.idx",
                "run `python -m ds_megatron.data prepare --out DIR ...` for it, or pass a Megatron prefix",
            )
        manifest = check_prepared_dir(run, directory, setting)
        fingerprints[directory] = manifest["tokenizer"]["fingerprint"]
    check_one_tokenizer(fingerprints, setting)
    if not megatron:
        return
    given = run.section.data.tokenizer
    prepared_tok = str(Path(next(iter(fingerprints))) / TOKENIZER_DIR) if fingerprints else None
    spec = tokenizer_spec(given, prepared_tok, "ds_megatron.data.tokenizer")
    tok = load_fitting_tokenizer(run, spec)
    if fingerprints and spec == given:
        from ds_megatron.data.corpus import tokenizer_fingerprint

        theirs = next(iter(fingerprints.values()))
        if tokenizer_fingerprint(tok) != theirs:
            raise ConfigError(
                "ds_megatron.data.tokenizer",
                "not the tokenizer the blended prepared directories were made with",
                f"{spec}: {tokenizer_fingerprint(tok)}, {next(iter(fingerprints))}: {theirs}",
                "pass the tokenizer of the whole blend, or leave --tokenizer out to use the prepared directories'",
            )
    for ds in megatron:
        check_megatron_ids(run, ds, len(tok), spec)
        check_megatron_documents(run, ds, spec, tok)


def check_tokenizer_files(run: RunConfig) -> int:
    """The settings of text tokenised in the launch; ``bpe:N`` or a directory, whose tokenizer must fit the model's
    vocabulary.  Returns the tokenizer's size."""
    check_text_settings(run)
    spec = effective_tokenizer(run)
    if spec.startswith("bpe:"):
        return int(spec.removeprefix("bpe:"))
    return len(load_fitting_tokenizer(run, spec))


def load_fitting_tokenizer(run: RunConfig, spec: str):
    """The tokenizer directory ``spec``, refused when it is larger than the model's vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec)
    check_tokenizer_fits(len(tok), f"{len(tok)} tokens in {spec}", run.model.vocab_size, CONFIG_FILE_RULES)
    return tok


def check_init_from_hf(run: RunConfig, init: Path) -> None:
    setting = "ds_megatron.checkpoint.init_from_hf"
    if not (init / "config.json").is_file():
        raise ConfigError(
            setting,
            "not a transformers model directory",
            f"{init} has no config.json",
            "pass a directory written by `python -m ds_megatron.checkpoint export` or save_pretrained",
        )
    from ds_megatron.checkpoint.hf_import import check_hf_config, check_hf_tensors
    from ds_megatron.model import model_config

    config = model_config(run.model)
    check_hf_config(init, config, setting)
    check_hf_tensors(init, config, setting)  # every file readable, every parameter there: before any process group


def check_resume(run: RunConfig, load: Path) -> None:
    """``--load`` needs a complete checkpoint whose model and layout match this run, and whose files are safe to
    read (``check_resume_files``)."""
    from ds_megatron.checkpoint.manifest import resume_tag

    tag = resume_tag(load)
    check_resume_shape(run, load, tag)
    check_resume_files(load, tag)


def check_resume_files(load: Path, tag: str) -> None:
    """Once per node (its first process; the same files give the same answer on every node, and rank 0 prints
    it): the tag holds no file a loader would open that its manifest does not list, and every torch file of it
    unpickles weights-only.  Only each file's pickle is read (tensor data is memory-mapped), so the cost grows with
    the number of tensors, not with their bytes.  The few files that would have to be read whole for this
    (``safe_load.cheap_to_check``) are checked in the launch, with the sha256 of every file
    (``run_state.verified_load_tag``, each rank a share)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from ds_megatron.checkpoint import safe_load
    from ds_megatron.checkpoint.manifest import checksum_mismatch, corrupt_checkpoint, unlisted
    from ds_megatron.checkpoint.run_state import LOAD_SETTING, UNSAFE_FIX, corrupt_fix

    problem = unlisted(load / tag)
    if problem is not None:
        raise corrupt_checkpoint(LOAD_SETTING, problem, corrupt_fix(load, tag))
    for f in sorted((load / tag).glob("*.pt")):
        if not safe_load.cheap_to_check(f):
            continue
        try:
            what = safe_load.unsafe_reason(f)
        except Exception as err:  # torch's reader on a damaged file: any of several types
            what, unreadable = None, (str(err).strip().splitlines() or [type(err).__name__])[0]
        else:
            unreadable = None
        if what is None and unreadable is None:
            continue
        # A damaged pickle reads like one that asks for odd globals, or not at all: say which it is.
        damaged = checksum_mismatch(load / tag, [f.name])
        if damaged is not None:
            raise corrupt_checkpoint(LOAD_SETTING, damaged, corrupt_fix(load, tag))
        if what is not None:
            raise safe_load.refusal(f, what, LOAD_SETTING, UNSAFE_FIX)
        raise ConfigError(
            LOAD_SETTING, "a checkpoint file cannot be read", f"{tag}/{f.name}: {unreadable}", corrupt_fix(load, tag)
        )


def check_resume_shape(run: RunConfig, load: Path, tag: str) -> None:
    """The checkpoint's model shape (and, under fp16, its layout) is this run's."""
    from ds_megatron.checkpoint.manifest import tag_config

    saved = tag_config(load, tag)
    if saved is None:
        return
    try:
        old = resolve(saved, saved_world(saved))
    except ConfigError:
        return
    for key in SHAPE_KEYS:
        a, b = getattr(old.model, key), getattr(run.model, key)
        if a != b:
            raise ConfigError(
                "ds_megatron.checkpoint.load",
                f"checkpoint model shape does not match the config ({key})",
                f"{key}={a} in {load}/{tag}, {b} in the config",
                f"set ds_megatron.model.{key}={a} or start a new run",
            )
    fp16 = "fp16" in (precision(old.ds_config), precision(run.ds_config))
    if needs_resharding(old.ds_config, run.ds_config) and fp16:
        with_cp = old.cp > 1 or run.cp > 1  # cp named only where a run sets it

        def layout(r: RunConfig) -> str:
            return layout_text(r.tp, r.cp, r.pp, r.dp, with_cp)

        raise ConfigError(
            "ds_megatron.checkpoint.load",
            f"an fp16 run resumes only at the tp, pp and {'dp x cp' if with_cp else 'dp'} it was saved at (its "
            "loss-scaler state is not resharded)",
            f"{layout(old)} in {load}/{tag}, {layout(run)} now",
            f"resume with --tp {old.tp}" + (f" --cp {old.cp}" if with_cp else "") + f" --pp {old.pp} on "
            f"{old.world_size} processes, or export and --init-from-hf",
        )
