"""The errors sdkiln raises for bad input. The CLI prints them as one line, without a traceback.

Another library's parser (diffusers, transformers, tokenizers, yaml) is called inside
``third_party``, which turns its failure into one of these naming the file. Nothing else is caught
broadly: a bug in sdkiln's own code keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_SDKILN_DIR = Path(__file__).resolve().parent


class SdkilnError(Exception):
    """Base of every error that is the user's input, not a bug: printed as one line by the CLI."""


class PackageError(SdkilnError):
    """A package on disk is missing, corrupt, tampered with, unsafe, or of an unsupported version."""


class RecipeError(SdkilnError):
    """A recipe name, file or step config is unknown or invalid."""


class ModelError(SdkilnError):
    """A model name or path does not resolve, or a base model does not match a package."""


class StepError(SdkilnError):
    """A step-dependent model ran with a step count or step index it was not calibrated for, or
    outside a pipeline whose scheduler says which denoising step it is."""


class RunError(SdkilnError):
    """A package's pipeline failed inside another library while generating."""


class DeviceError(SdkilnError):
    """A device was asked for that this machine does not have."""


class ParallelError(SdkilnError):
    """A parallel layout does not fit the launch or the model, or a peer rank failed or stopped
    answering during a parallel run."""


@contextmanager
def third_party(where: str, what: str, error: type[SdkilnError] = None) -> Iterator[None]:
    """Run another library's parser or constructor on input we were given: any failure of it becomes
    one ``error`` (default ``PackageError``) naming ``where``. Only calls into other libraries
    belong inside, never sdkiln's own logic."""
    try:
        yield
    except SdkilnError:
        raise
    except (Exception, RecursionError) as exc:  # another library's parser: any failure means bad input
        text = str(exc).strip()
        message = text.splitlines()[0][:300] if text else ""
        raise (error or PackageError)(f"{where}: {what} failed ({type(exc).__name__}: {message})") from None


@contextmanager
def failures_outside_sdkiln(what: str) -> Iterator[None]:
    """Run a loaded pipeline: an exception raised inside another library (diffusers, transformers,
    torch's Python code) becomes one ``RunError``, since a package can carry configs consistent in
    every field the loader checks yet unusable together. One raised in sdkiln's own code (the
    innermost frame is ours) keeps its traceback: that is our bug, not the package's."""
    try:
        yield
    except SdkilnError:
        raise
    except Exception as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = Path(tb.tb_frame.f_code.co_filename) if tb is not None else None
        if where is None or where.is_relative_to(_SDKILN_DIR):
            raise
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        raise RunError(
            f"{what} failed in {where.parent.name}/{where.name}:{tb.tb_lineno} ({type(exc).__name__}: {message}); "
            "the package's configs do not work together (sdkiln --debug shows the traceback)"
        ) from None
