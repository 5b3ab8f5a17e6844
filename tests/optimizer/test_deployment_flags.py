"""optimize's deployment flags (--height, --width, --frames, --max-sequence-length): the package is made for, records and
runs at what the user gave; a size the family cannot take is refused in one line."""

import json

import numpy as np
import pytest
from PIL import Image

from sdkiln.cli import main


def test_the_package_is_made_for_and_runs_at_the_given_size(tmp_path, capsys):
    out = tmp_path / "pkg"
    args = ["optimize", "flux-tiny", "--recipe", "w8a8-dynamic", "--height", "48", "--width", "64"]
    assert main([*args, "--max-sequence-length", "24", "--out", str(out), "--eval-samples", "1"]) == 0
    defaults = json.loads((out / "manifest.json").read_text())["call"]["defaults"]
    assert (defaults["height"], defaults["width"], defaults["max_sequence_length"]) == (48, 64, 24)
    png = tmp_path / "a.png"
    assert main(["run", str(out), "--prompt", "a cat", "--out", str(png)]) == 0  # no size given
    assert np.asarray(Image.open(png)).shape[:2] == (48, 64)


@pytest.mark.parametrize(
    "model, flags, message",
    [
        ("flux-tiny", ["--height", "50"], "flux-tiny takes multiples of 16"),
        ("wan-tiny", ["--frames", "6"], "wan-tiny takes 4k + 1 frames (e.g. 5)"),
        ("fmnist-flux", ["--height", "32"], "fmnist-flux calls its pipeline without height"),
        ("flux-tiny", ["--frames", "5"], "flux-tiny calls its pipeline without num_frames"),
        ("flux-tiny", ["--max-sequence-length", "600"], "flux-tiny's pipeline takes at most 512 text tokens"),
        (
            "fmnist-flux",
            ["--max-sequence-length", "8"],
            "fmnist-flux calls its pipeline without max_sequence_length",
        ),
    ],
)
def test_a_size_the_family_cannot_take_is_one_error(tmp_path, capsys, model, flags, message):
    out = tmp_path / "pkg"
    assert (
        main(["optimize", model, "--recipe", "none", *flags, "--out", str(out), "--eval-samples", "0"]) == 2
    )
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
