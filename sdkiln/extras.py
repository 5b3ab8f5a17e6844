"""Optional dependencies: ``sdkiln`` as installed stays lean, and a feature that needs more names the
extra that brings it (``pip install 'sdkiln[onnx]'``)."""

from __future__ import annotations

import importlib.util

from sdkiln.errors import SdkilnError


def require(*modules: str, extra: str, what: str) -> None:
    """SdkilnError naming ``extra`` unless every one of ``modules`` can be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SdkilnError(
            f"{what} needs {', '.join(missing)}, which is not installed: pip install 'sdkiln[{extra}]'"
        )
