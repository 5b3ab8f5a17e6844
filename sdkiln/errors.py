"""The errors sdkiln raises for bad input. The CLI prints them as one line, without a traceback."""


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
