"""Qwen2-VL's processor for a picture and text, without a video processor.

transformers (5.x) builds ``Qwen2VLProcessor`` only with its video processor, and builds that only with
torchvision installed, which sdkiln does not depend on. ``QwenImageEditPipeline`` gives its processor one
picture and the prompt, never a video, so the zoo's Qwen-Image-Edit build (``model_zoo.qwen_image_edit``)
uses this subclass: the same image and text processing, saved and loaded as a transformers processor
(``save_pretrained`` / ``from_pretrained``), with no video processor among its parts. A pipeline saved
with it names it in model_index.json as ``["sdkiln.model_zoo.qwen_vl_processor", "Qwen2VLImageTextProcessor"]``.
A published directory's ``Qwen2VLProcessor`` loads as this class where torchvision is absent
(:func:`substitute`, used by ``model_zoo.load_model`` and the package loader), with a warning.
"""

from __future__ import annotations

from typing import Any

from transformers import ProcessorMixin, Qwen2VLProcessor

# ProcessorMixin is a name of this module on purpose: diffusers' from_pretrained learns how to load a
# component of a module outside diffusers and transformers by looking up the loadable base classes
# (ProcessorMixin: from_pretrained) by name in that module.
__all__ = ["ProcessorMixin", "Qwen2VLImageTextProcessor", "SUBSTITUTES", "substitute"]


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` whose parts are its image processor and tokenizer (transformers reads a
    processor's parts off its constructor's parameters)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


SUBSTITUTES = {("transformers", "Qwen2VLProcessor"): Qwen2VLImageTextProcessor}
"""Processors whose transformers class cannot be built without torchvision, and the class that loads
their folder instead: a published Qwen-Image-Edit directory names transformers' ``Qwen2VLProcessor``."""


def substitute(library: str, class_name: str, where: str) -> type | None:
    """The class to load a ``library``/``class_name`` component as where torchvision is absent, with one
    warning on the ``sdkiln.load`` logger naming ``where`` (the component); None where the named class
    can be built (torchvision installed, or not a class listed in :data:`SUBSTITUTES`)."""
    import importlib.util
    import logging

    cls = SUBSTITUTES.get((library, class_name))
    if cls is None or importlib.util.find_spec("torchvision") is not None:
        return None
    logging.getLogger("sdkiln.load").warning(
        "%s: transformers' %s builds a video processor, which needs torchvision (not installed); loading "
        "it as %s.%s: the same picture and text processing (the picture resized with PIL), no video",
        where,
        class_name,
        __name__,
        cls.__name__,
    )
    return cls
