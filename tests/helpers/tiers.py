"""The two tiers of a parametrized test: the default tier keeps a few representative cases, `-m slow` runs the rest
(docs/dev/testing.md)."""

import pytest


def slow_but(cases, *kept):
    """`cases` for pytest.mark.parametrize, each not in `kept` marked slow. A tuple is one case's arguments (for
    several argument names); ids are as they would be without the marks."""
    return [case if case in kept else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                   marks=pytest.mark.slow) for case in cases]
