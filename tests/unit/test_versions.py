"""The supported versions (ds_megatron/versions.py): pyproject.toml declares them, the installed ones pass, and
``import ds_megatron`` refuses an untested deepspeed or too old a torch in one line, before anything reaches
DeepSpeed's private pipeline-engine names; the torch-free tuner still imports when neither package is installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from ds_megatron import versions

ROOT = Path(__file__).resolve().parents[2]


def fake_versions(**installed):
    def version_of(name):
        if name in installed and installed[name] is not None:
            return installed[name]
        if name in installed:
            raise metadata.PackageNotFoundError(name)
        return metadata.version(name)

    return version_of


def test_pyproject_declares_the_bounds_of_versions_py():
    # the quoted requirement lines of [project] dependencies (tomllib is Python 3.11+, the package supports 3.10)
    text = (ROOT / "pyproject.toml").read_text()
    by_name = {name: name + bounds for name, bounds in re.findall(r'^\s*"([a-z]+)([<>=!~][^"]*)",', text, re.M)}
    for name, requirement in versions.REQUIREMENTS.items():
        assert by_name[name] == requirement, (name, by_name[name], requirement)


def test_the_installed_versions_pass():
    assert versions.problems() == [], versions.problems()
    versions.check_installed()


@pytest.mark.parametrize(
    "installed, bad",
    [
        ({"deepspeed": "0.20.0"}, "deepspeed 0.20.0"),
        ({"deepspeed": "1.0.1"}, "deepspeed 1.0.1"),
        ({"deepspeed": "0.19.2"}, "deepspeed 0.19.2"),
        ({"torch": "2.7.1+cu126"}, "torch 2.7.1+cu126"),
        ({"torch": "2.4.0"}, "torch 2.4.0"),
    ],
)
def test_out_of_bounds_versions_are_refused_in_one_line(installed, bad, monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)
    with pytest.raises(ImportError) as err:
        versions.check_installed(fake_versions(**installed))
    message = str(err.value)
    assert "\n" not in message and message.startswith(bad), message
    name = bad.split()[0]
    assert f"pip install '{versions.REQUIREMENTS[name]}'" in message and versions.SKIP_ENV in message, message


@pytest.mark.parametrize(
    "installed",
    [
        {"deepspeed": "0.19.3", "torch": "2.8.0"},
        {"deepspeed": "0.19.99+abc", "torch": "2.8.0a0+git1234"},  # a source build of 2.8 is 2.8
        {"deepspeed": None, "torch": None},  # the tuner's environment: neither installed
        {"deepspeed": None, "torch": "3.0.0"},
    ],
)
def test_in_bounds_or_missing_packages_pass(installed):
    assert versions.problems(fake_versions(**installed)) == []


def test_the_skip_variable_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv(versions.SKIP_ENV, "1")
    with pytest.warns(UserWarning, match="deepspeed 0.20.0"):
        versions.check_installed(fake_versions(deepspeed="0.20.0"))


def _import_with_fake_dist(tmp_path: Path, name: str, version: str, module: str) -> subprocess.CompletedProcess:
    """``import module`` in a fresh interpreter whose metadata shows ``name`` at ``version`` (a dist-info first on
    the path; the real package stays importable behind it)."""
    info = tmp_path / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    env.pop(versions.SKIP_ENV, None)
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)


def test_import_ds_megatron_refuses_deepspeed_0_20(tmp_path):
    proc = _import_with_fake_dist(tmp_path, "deepspeed", "0.20.0", "ds_megatron.tune")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: deepspeed 0.20.0 is installed, ds_megatron needs deepspeed>=0.19.3,<0.20")


def test_import_ds_megatron_passes_a_tested_deepspeed(tmp_path):
    proc = _import_with_fake_dist(tmp_path, "deepspeed", "0.19.8", "ds_megatron.tune")
    assert proc.returncode == 0, proc.stderr
