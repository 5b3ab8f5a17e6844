"""Writers: the sdkiln package (manifest + safetensors + quality report). Ascend and ONNX come later."""

from sdkiln.export.package_writer import write_package

__all__ = ["write_package"]
