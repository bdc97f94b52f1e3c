"""Data on many nodes: two nodes of two processes each on this machine (DeepSpeed's launcher with ``--no_ssh
--node_rank``), a data cache of its own per node (as on node-local disks) and one shared checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launch import RECIPE, deepspeed_launch_nodes, quiet_run_flags, read_losses
from test_data_prepare import make_tokenizer, run_prepare, write_corpus
from test_data_training import TINY

from ds_megatron.fileio import sha256_file


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.mark.slow
def test_two_nodes_with_their_own_data_caches_train_save_and_resume(tmp_path):
    """Leg 1 (steps 1-2, tp 2 x pp 2): raw text tokenised in the launch; each node builds the packed cache in its own
    data.cache_dir (its two processes share it through the file lock), the two caches are identical, and the
    checkpoint lands in the shared directory.  Leg 2 (step 3): resumes from that checkpoint with the prepared
    directory of the same text and tokenizer (the same token stream, so the run continues on the same samples):
    nothing is tokenised, no cache is touched, the tokenizer is saved, and the ignored data.valid_fraction is one
    warning for the whole job."""
    tok = make_tokenizer(tmp_path / "tok")
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    prepared = tmp_path / "prepared"
    run_prepare(corpus, tok, prepared, progress=False)  # valid_fraction 0.02, as data.valid_fraction's default
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    caches = [tmp_path / f"node{i}-cache" for i in range(2)]
    common = ["--deepspeed_config", str(TINY), "--tokenizer", str(tok), "--save", str(ck)]
    common += [*quiet_run_flags(tmp_path, "run", tp=2, pp=2), "--set", "ds_megatron.data.num_proc=1"]

    def own_cache(node: int) -> list[str]:
        return ["--set", f"ds_megatron.data.cache_dir={caches[node]}"]

    deepspeed_launch_nodes(RECIPE, 2, 2, ["--data", corpus, "--train-iters", "2", *common], own_cache)
    # Each node built the packed file in its own cache.  (Not read off the "tokenizing" progress bar: `datasets`
    # skips it when its own map cache already holds this corpus from an earlier run of the same text.)
    built = [sorted(cache.glob("*.bin")) for cache in caches]
    assert [len(b) for b in built] == [1, 1] and built[0][0].name == built[1][0].name
    assert sha256_file(built[0][0]) == sha256_file(built[1][0])
    assert sorted(read_losses(run_dir)) == [1, 2] and (ck / "step00000002" / "manifest.json").is_file()
    before = [snapshot(cache) for cache in caches]
    os.remove(run_dir / "tokenizer" / "tokenizer.json")

    resume = ["--data", str(prepared), "--train-iters", "3", "--load", str(ck), *common]
    outs = deepspeed_launch_nodes(RECIPE, 2, 2, [*resume, "--set", "ds_megatron.data.valid_fraction=0.1"], own_cache)
    joined = "\n".join(outs)
    assert "data: prepared directory" in joined and "tokenizing" not in joined
    assert [snapshot(cache) for cache in caches] == before  # nothing tokenised, nothing cached
    warning = f"warning: ds_megatron.data.valid_fraction=0.1 is ignored: {prepared} was prepared with 0.02"
    assert joined.count(warning) == 1
    assert sorted(read_losses(run_dir)) == [1, 2, 3] and (ck / "step00000003" / "manifest.json").is_file()
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
