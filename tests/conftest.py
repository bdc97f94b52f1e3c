"""The test tree: ``unit/`` runs in-process (``make test-fast``), ``launcher/`` starts real processes with DeepSpeed's
launcher (the slow tier).  Both import the shared helpers beside this file (``launch``, ``inprocess``,
``miniature``), and a launcher file may import a helper of the unit file it was split from, so both folders are on
the import path."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE / "unit"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def pytest_sessionstart(session):
    """Stale state first (``launch.clear_stale_state``).  Then a session of the whole unit tier (its folder or one
    above it) starts the in-process harness's fork server first: the server imports torch and deepspeed on the core
    that collection leaves idle.  A session of single files starts it with its first pool, if any."""
    import launch

    launch.clear_stale_state()
    unit = HERE / "unit"
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in session.config.args]
    if any(path == unit or path in unit.parents for path in paths):
        import inprocess

        inprocess.start_fork_server()


def pytest_collection_modifyitems(config, items):
    """The folder is the tier: every test of ``launcher/`` is marked slow, and a test of ``unit/`` marked slow (it
    starts the launcher) is an error naming the folder it belongs in.  The in-process harness's own tests run first:
    one of them replaces the pool of two ranks, and a replacement made later in the session would import again
    every test module that the earlier jobs had imported on those ranks."""
    items.sort(key=lambda item: Path(str(item.fspath)).name != "test_inprocess.py")  # stable: the rest keep order
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        slow = item.get_closest_marker("slow") is not None
        if folder == "unit" and slow:
            raise pytest.UsageError(f"{item.nodeid}: a launcher test (marked slow) belongs in tests/launcher/")
        if folder == "launcher" and not slow:
            item.add_marker(pytest.mark.slow)
