"""docs/tuner.md shows the analytic tuner's output verbatim: every ```bash command of the tuner followed by an
"Output (verbatim ...)" block is run here and must print that block (the search time aside), so a change to the
tuner's models or report shows up as a change to its documentation."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from ds_megatron.tune.__main__ import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "tuner.md"
# A ```bash block holding one tuner command (no other block inside), then its verbatim output block.
EXAMPLE = re.compile(
    r"```bash\n(python -m ds_megatron\.tune (?:(?!```).)*)```\n\nOutput \(verbatim[^\n]*\n\n```\n(.*?)```", re.S
)
SEARCH_TIME = re.compile(r"candidates in [0-9.]+ s:")


def _examples() -> list[tuple[list[str], str]]:
    found = []
    for command, output in EXAMPLE.findall(DOC.read_text()):
        args = shlex.split(command.replace("\\\n", " "))[3:]  # drop "python -m ds_megatron.tune"
        found.append((args, output))
    return found


def test_the_documented_examples_are_found():
    assert len(_examples()) >= 2  # GPT-3 175B on 1,024 A100s and Llama 3 8B on 8 H100s


@pytest.mark.parametrize("args,expected", _examples(), ids=lambda v: v[1] if isinstance(v, list) else None)
def test_documented_output_is_what_the_tuner_prints(args, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the written JSON and config land here, under the names the example prints
    assert main(args) == 0
    printed = SEARCH_TIME.sub("candidates in X s:", capsys.readouterr().out)
    assert printed == SEARCH_TIME.sub("candidates in X s:", expected)
