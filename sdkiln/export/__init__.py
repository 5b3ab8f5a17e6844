"""Writers: the sdkiln package (manifest + safetensors + quality report) and the Ascend (MindIE SD)
files. ONNX comes later."""

from sdkiln.export.ascend import export_ascend
from sdkiln.export.package_writer import write_package

__all__ = ["export_ascend", "write_package"]
