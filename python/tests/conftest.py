"""Shared pytest fixtures of the binding's tests."""

import pytest

import moefuse
from moefuse import _lib


@pytest.fixture(scope="module")
def library():
    """The library is what is under test: missing is a failure, not a skip. Modules that
    test it say `pytestmark = pytest.mark.usefixtures("library")`."""
    if not moefuse.is_available():
        try:
            _lib.load()
        except _lib.LibraryNotFoundError as err:
            pytest.fail(f"libmoefuse not loadable: {err}")
    yield
