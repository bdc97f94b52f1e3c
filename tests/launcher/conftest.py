"""The modules with a selected test, for the launches that several modules share (``launch.shared_launch``)."""

import launch


def pytest_collection_finish(session):
    launch.SELECTED_MODULES = {item.module.__name__ for item in session.items if getattr(item, "module", None)}
