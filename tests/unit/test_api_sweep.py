"""The Python API's names as a notebook finds them."""

from __future__ import annotations

import cleave


def test_the_api_names_are_offered_for_completion() -> None:
    """`cleave.<Tab>` in a notebook lists what `dir(cleave)` holds: it offered none of the API's names."""
    assert set(cleave.__all__) <= set(dir(cleave))
    assert all(callable(getattr(cleave, name)) for name in cleave.__all__)
