"""The built-in demo corpus: real English prose that ships with every CPython (the reference documentation text in
``pydoc_data.topics``, about 0.47 MB), so the demo needs no network and no data files."""

from __future__ import annotations


def builtin_documents() -> list[str]:
    """CPython's reference documentation, one document per topic (about 0.47 MB of English prose and code)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]
