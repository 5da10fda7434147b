"""A griffe extension for the docs site: Sphinx roles in docstrings render as code.

The docstrings use ``:class:`Name```, ``:func:`~mod.name``` and the like; mkdocstrings has no
Sphinx roles, so without this they show as ``:class:`Name``` text. ``~`` keeps the last part.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1]}`" if match.group(1) else f"`{name}`"


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` as ```target``` in every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the roles of one object's docstring."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
