"""The tokenizer a checkpoint's weights were trained with travels with them: every tag holds it in ``tokenizer/``,
listed in the tag's manifest (so hashed, verified and copied with the weights), and a tag is exportable on its own
whatever other runs wrote elsewhere since.

Writers: every save of a training run (``run_state.save_run``, the run's own tokenizer), ``import`` (the transformers
directory's, when it has one) and ``reshard`` (the source tag's).  Readers check it: ``export`` ships it (and refuses
a ``--tokenizer`` that is another tokenizer, or a tag without one unless ``--tokenizer`` is given); a run that
``--load``s a tag or starts ``--init-from-hf`` refuses to train with another tokenizer than the weights'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ds_megatron.checkpoint.manifest import TOKENIZER_DIR
from ds_megatron.config import ConfigError

# Either file marks a directory AutoTokenizer can load (``save_pretrained`` writes both for a fast tokenizer).
MARKERS = ("tokenizer_config.json", "tokenizer.json")
# The parts of a fast tokenizer's definition that decide how text becomes ids (not its truncation or padding, which
# a call can change).
RULES = ("model", "normalizer", "pre_tokenizer", "added_tokens")


def has_tokenizer(directory: str | Path) -> bool:
    return any((Path(directory) / m).is_file() for m in MARKERS)


def tag_tokenizer(tag_dir: str | Path) -> Path | None:
    """The tag's tokenizer directory, or None for a tag written without one."""
    directory = Path(tag_dir) / TOKENIZER_DIR
    return directory if has_tokenizer(directory) else None


def save_tokenizer(tok, tag_dir: Path) -> None:
    """Write ``tok`` into the tag (before its manifest is written, which then lists its files); a tag of the same
    name written before keeps no file of its tokenizer."""
    shutil.rmtree(tag_dir / TOKENIZER_DIR, ignore_errors=True)
    tok.save_pretrained(str(tag_dir / TOKENIZER_DIR))


def copy_tokenizer(src_tag: Path, tag_dir: Path) -> None:
    """The source tag's tokenizer files, byte for byte, into ``tag_dir`` (nothing when it has none)."""
    src = tag_tokenizer(src_tag)
    if src is not None:
        shutil.copytree(src, tag_dir / TOKENIZER_DIR)


def load_tokenizer(directory: str | Path, setting: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(setting, "not a tokenizer directory", f"{directory}: {first}", "pass one") from None


def difference(ours, theirs) -> str | None:
    """How two tokenizers differ in what the model sees (vocabulary, BOS/EOS ids, the rules that split text), or
    None when they give the same ids."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    differ = sum(1 for token in mine.keys() | other.keys() if mine.get(token) != other.get(token))
    if differ:
        return f"{differ:,} of {max(len(mine), len(other)):,} vocabulary entries differ"
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(ours, name) != getattr(theirs, name):
            return f"{name} {getattr(ours, name)} vs {getattr(theirs, name)}"
    if _rules(ours) != _rules(theirs):
        return "same vocabulary, other rules for splitting text (merges, normalizer or pre-tokenizer)"
    return None


def _rules(tok) -> dict | None:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its vocabulary is what can be compared
        return None
    spec = json.loads(backend.to_str())
    return {k: spec.get(k) for k in RULES}


def check_same(tok, saved: Path, setting: str, what: str, fix: str) -> None:
    """Refuse ``tok`` unless it is the tokenizer in ``saved`` (``what``: whose tokenizer that is)."""
    problem = difference(tok, load_tokenizer(saved, setting))
    if problem is not None:
        raise ConfigError(setting, f"not the tokenizer {what}", f"{problem}; its tokenizer: {saved}", fix)


def check_fits(tok, vocab_size: int, setting: str, source: Path) -> None:
    """A tokenizer whose ids reach past the model's vocabulary cannot be the one it was trained with."""
    from ds_megatron.config.rules import CONFIG_FILE_RULES, check_tokenizer_fits

    check_tokenizer_fits(len(tok), f"{len(tok)} tokens in {source}", vocab_size, CONFIG_FILE_RULES, setting)


def check_run_tokenizer(run, tok, load_tag: str | None) -> None:
    """The run trains its weights on with the tokenizer they were trained with: a ``--load`` tag's (when it holds
    one), else an ``--init-from-hf`` directory's (when it has one).  ConfigError otherwise."""
    ck, setting = run.section.checkpoint, "ds_megatron.data.tokenizer"
    if ck.load and load_tag is not None:
        saved = tag_tokenizer(Path(ck.load) / load_tag)
        if saved is not None:
            fix = f"resume with that tokenizer (--tokenizer {saved}, or data prepared with it)"
            check_same(tok, saved, setting, f"{ck.load}/{load_tag} was trained with", fix)
    elif ck.init_from_hf and has_tokenizer(ck.init_from_hf):
        fix = f"train with that tokenizer (--tokenizer {ck.init_from_hf}, or data prepared with it)"
        check_same(tok, Path(ck.init_from_hf), setting, f"of {ck.init_from_hf}", fix)
