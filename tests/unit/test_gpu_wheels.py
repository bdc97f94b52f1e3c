"""benchmarks/gpu_wheels.sh fetches everything ``import deepspeed`` and transformers need on a GPU machine with torch
and no network: every runtime Requires-Dist of deepspeed (read from its own metadata, so the list cannot drift), for
every CPython the package supports, and writes the pinned list gpu_check.sh installs for each.  Run here with a
stand-in for pip (it records the command and writes an empty wheel per requested name): no network, about a second."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import wheel_list  # noqa: E402

FAKE_PYTHON = f"""#!{sys.executable}
import json, os, re, sys, zipfile
args = sys.argv[1:]
if args[:2] != ["-m", "pip"]:
    os.execv({sys.executable!r}, [{sys.executable!r}, *args])
log = os.environ["FAKE_PIP_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(args[2:]) + "\\n")
out = args[args.index("-w" if args[2] == "wheel" else "-d") + 1]
os.makedirs(out, exist_ok=True)
if args[2] == "wheel":  # deepspeed's wheel, with the metadata of the installed deepspeed
    with zipfile.ZipFile(os.path.join(out, "deepspeed-0.19.8-py3-none-any.whl"), "w") as z:
        z.writestr("deepspeed-0.19.8.dist-info/METADATA", os.environ["FAKE_DS_METADATA"])
    sys.exit(0)
valued = {{"-d", "--python-version", "--implementation", "--platform"}}
names = [a for i, a in enumerate(args[3:], 3) if not a.startswith("-") and args[i - 1] not in valued]
for name in names:
    bare = re.split(r"[\\s<>=!~;\\[]", name)[0].replace("-", "_")
    open(os.path.join(out, f"{{bare}}-1.0-py3-none-any.whl"), "w").close()
"""


def _deepspeed_runtime_names() -> set[str]:
    """deepspeed's requirements outside any extra, as the installed distribution states them, less torch."""
    names = set()
    for requirement in metadata.requires("deepspeed"):
        if "extra ==" in requirement.split(";", 1)[-1] and ";" in requirement:
            continue
        names.add(re.split(r"[\s<>=!~;\[]", requirement)[0].lower())
    return names - {"torch"}


def test_runtime_requirements_are_deepspeeds_own_less_torch_and_extras():
    text = metadata.distribution("deepspeed").read_text("METADATA")
    got = {re.split(r"[\s<>=!~;\[]", r)[0].lower() for r in wheel_list.runtime_requirements(text)}
    assert got == _deepspeed_runtime_names()
    assert {"msgpack", "psutil", "einops", "py-cpuinfo", "hjson", "pydantic", "packaging", "tqdm"} <= got, got


def test_gpu_wheels_fetches_every_runtime_requirement_for_every_python(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log, wheels = tmp_path / "pip.jsonl", tmp_path / "whl"
    env = dict(
        os.environ,
        PYTHON=str(fake),
        WHEELS=str(wheels),
        FAKE_PIP_LOG=str(log),
        FAKE_DS_METADATA=metadata.distribution("deepspeed").read_text("METADATA"),
    )
    env.pop("GPU_PYTHONS", None)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_wheels.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    downloads = {c[c.index("--python-version") + 1]: c for c in calls if c[0] == "download"}
    low = re.search(r'requires-python = ">=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert set(downloads) == {f"3.{minor}" for minor in range(int(low.split(".")[1]), 14)}, sorted(downloads)
    for version, call in downloads.items():
        fetched = {re.split(r"[\s<>=!~;\[]", a)[0].lower() for a in call if not a.startswith("-")}
        assert _deepspeed_runtime_names() | {"transformers"} <= fetched, (version, sorted(fetched))
        assert "torch" not in fetched and "--no-deps" not in call, call  # their own needs are resolved too
        pins = (wheels / f"cp{version.replace('.', '')}.txt").read_text().split()
        assert "deepspeed==0.19.8" in pins and "msgpack==1.0" in pins and "transformers==1.0" in pins, pins
    with zipfile.ZipFile(next(wheels.glob("deepspeed-*.whl"))) as z:
        assert z.namelist() == ["deepspeed-0.19.8.dist-info/METADATA"]
