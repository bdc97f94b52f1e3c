"""Writing a benchmark's result as markdown: a title, the date, the machine and the command, then the table."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def machine_line() -> str:
    """Date, CPU architecture, core count and torch version: what a reader needs to compare two results."""
    return (
        f"{datetime.date.today().isoformat()}, {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"
    )


def write_markdown(path: str, title: str, command: str, body: str) -> None:
    with open(path, "w") as f:
        f.write(f"# {title}\n\n{machine_line()}, `{command}`\n\n{body}\n")
