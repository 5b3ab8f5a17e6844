"""Loading and running a package imports nothing of the offline job (optimizer, calibrate, export,
sparsify), and no sdkiln module imports triton or torch_npu: a user who only loads packages pays
for neither. (diffusers itself imports ``torch._dynamo`` on import, which imports triton where it
is installed, and imports torch_npu where that is installed: ``../shared/ENVIRONMENT.md``.)"""

import json
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "schema1_flux_tiny" / "package"
OFFLINE = ("sdkiln.optimizer", "sdkiln.calibrate", "sdkiln.export", "sdkiln.sparsify")

# Run in a fresh interpreter: an import finder records, for every attempt to import triton or
# torch_npu (installed or not), the file and line of the statement that asked for it; then the fixture
# package (every scheme, a cache schedule) is loaded and run, and every runtime module imported.
CODE = f"""
import importlib, json, pkgutil, sys, traceback

asked = []

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "torch_npu"):
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename and "<frozen" not in f.filename]
            asked.append([name, frames[-1].filename, frames[-1].line])
        return None

sys.meta_path.insert(0, Watch())
import torch
import sdkiln, sdkiln.runtime
pipe = sdkiln.load({str(FIXTURE)!r}, device="cpu")
pipe(prompt="a cat", num_inference_steps=4, true_cfg_scale=2.0, negative_prompt="", height=32, width=32,
     max_sequence_length=16, output_type="np", generator=torch.Generator().manual_seed(0))
for m in pkgutil.walk_packages(sdkiln.runtime.__path__, "sdkiln.runtime."):
    importlib.import_module(m.name)
print(json.dumps({{"offline": sorted(m for m in sys.modules if m.startswith({OFFLINE!r})), "asked": asked}}))
"""


def test_loading_and_running_a_package_imports_nothing_offline_and_no_triton_or_torch_npu():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["offline"] == []
    sdkiln_root = str(Path(__file__).resolve().parents[2] / "sdkiln")
    ours = [a for a in report["asked"] if a[1].startswith(sdkiln_root)]
    # NPU detection asks whether torch_npu is installed (and imports it only where it is); nothing
    # of sdkiln imports either module
    assert ours and all("find_spec" in line for _, _, line in ours), ours
