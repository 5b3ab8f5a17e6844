"""The runtime never imports the offline modules (optimizer, calibrate, export, sparsify)."""

import subprocess
import sys

OFFLINE = ("sdkiln.optimizer", "sdkiln.calibrate", "sdkiln.export", "sdkiln.sparsify")


def test_loading_and_caching_import_nothing_offline():
    code = (
        "import sys\n"
        "import sdkiln.runtime.loader, sdkiln.runtime.cache, sdkiln.runtime.denoising, sdkiln.runtime.quant\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({OFFLINE!r}))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
