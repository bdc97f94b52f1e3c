"""Names for benchmarks/gpu_wheels.sh (standard library only, so it runs before anything is installed).

    python benchmarks/wheel_list.py requires WHEEL   # its runtime requirements, one a line (less extras and torch)
    python benchmarks/wheel_list.py pins WHEEL...    # name==version of each wheel file, one a line

``requires`` reads deepspeed's own Requires-Dist, so the wheels fetched for it follow its release instead of a copied
list; torch is left out because the GPU machine's torch (built for its CUDA) must stay the one that is used.
``pins`` writes the list benchmarks/gpu_check.sh installs for one Python version: an exact version per name, so that
wheels of other versions or Pythons lying in the same folder are never picked up.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

EXCLUDED = ("torch",)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0]


def runtime_requirements(metadata_text: str, excluded: tuple[str, ...] = EXCLUDED) -> list[str]:
    """The Requires-Dist lines that hold outside any extra, less ``excluded``, with their version bounds."""
    found = []
    for line in metadata_text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if re.search(r"\bextra\s*==", marker) or _name(requirement).lower() in excluded:
            continue
        found.append(requirement)
    return found


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return archive.read(name).decode()


def pin(wheel: Path) -> str:
    """``name==version`` of a wheel file (``name-version-...-tags.whl``)."""
    name, version = wheel.name.split("-")[:2]
    return f"{name}=={version}"


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "requires":
        print("\n".join(runtime_requirements(wheel_metadata(Path(argv[1])))))
    elif len(argv) >= 1 and argv[0] == "pins":
        print("\n".join(sorted({pin(Path(p)) for p in argv[1:]})))
    else:
        raise SystemExit(__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main(sys.argv[1:])
