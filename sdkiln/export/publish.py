"""``sdkiln publish``: a package to ModelScope or Modelers, with a model card.

The package is verified first (``open_package``), then its verified bytes (not the files on disk,
which could change after verification) are written to a fresh temporary directory together with
the hub's files: ``README.md``, the model card (what was optimized, the recipe, the stored quality report,
how to load it, the licence inherited from the base model) and ModelScope's ``configuration.json``.
The stage is uploaded by one function, ``upload`` (modelscope's ``HubApi`` or openMind's
``openmind_hub``), which tests replace with a local fake hub. The package directory itself is
never written: every path, success or failure, leaves it byte-identical, and the stage is removed.

The token comes from the environment (``MODELSCOPE_API_TOKEN`` / ``MODELERS_TOKEN``) and is passed
to the hub client's calls only (no ``login``, which would store credentials under the home
directory): sdkiln never writes it, and it is scrubbed from any error message.
The loader accepts the hub's files at a package's root unlisted (``runtime.package.HUB_FILES``), so
a downloaded package verifies like any other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdkiln.errors import SdkilnError
from sdkiln.export.summary import matched_text, quality_lines, summarize
from sdkiln.extras import require
from sdkiln.hub import valid_repo_id
from sdkiln.model_zoo import spec_names
from sdkiln.runtime.manifest_schema import check_quality
from sdkiln.runtime.package import HUB_FILES, MANIFEST, QUALITY_REPORT, Package, open_package

HUBS = {
    "modelscope": {"token": "MODELSCOPE_API_TOKEN", "module": "modelscope", "extra": "hub",
                   "url": "https://www.modelscope.cn/models/{repo}"},
    "modelers": {"token": "MODELERS_TOKEN", "module": "openmind_hub", "extra": "modelers",
                 "url": "https://modelers.cn/models/{repo}"},
}  # fmt: skip
CARD = "README.md"
CONFIGURATION = "configuration.json"
OWN_LICENSE = "apache-2.0"
"""The licence of the zoo's own models (the embedded model and the tiny configs with random weights)."""
TASKS = {"image": "text-to-image-synthesis", "video": "text-to-video-synthesis"}


@dataclass
class Published:
    repo: str
    hub: str
    url: str
    files: list[str]
    private: bool


Uploader = Callable[[Path, str, str, bool, str], str]
"""(staged directory, ORG/NAME, hub, private, token) -> the repository's URL."""


def upload(folder: Path, repo: str, hub: str, private: bool, token: str) -> str:
    """Upload ``folder`` as the model repository ``repo`` on ``hub`` (created if missing). The one
    call that reaches a network; tests replace it (``publish(..., uploader=...)``)."""
    if hub == "modelscope":
        from modelscope.hub.api import HubApi

        api = HubApi(token=token)
        api.create_repo(repo, token=token, visibility="private" if private else "public", exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(folder), token=token, commit_message="sdkiln publish")
    else:
        from openmind_hub import create_repo, upload_folder

        create_repo(repo, token=token, private=private, exist_ok=True)
        upload_folder(repo_id=repo, folder_path=str(folder), token=token, commit_message="sdkiln publish")
    return HUBS[hub]["url"].format(repo=repo)


def _license(manifest: dict[str, Any], license: str | None) -> str:
    base = manifest["model"]["base_id"]
    if license is not None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.+-]{0,63}", license):
            raise SdkilnError(
                f"--license {license!r}: give an SPDX-like licence id (apache-2.0, mit, other, ...)"
            )
        return license
    if base in spec_names():
        return OWN_LICENSE
    raise SdkilnError(
        f"the package's base model {base!r} is not one of sdkiln's own: pass --license with the base model's "
        "licence (the card inherits it)"
    )


def _deployment(manifest: dict[str, Any]) -> str:
    call = manifest["call"]
    d = call["defaults"]
    guidance = call["guidance_arg"]
    parts = [
        f"{d['num_inference_steps']} steps",
        f"{guidance} {d.get(guidance)}" if guidance else "guidance from the guider component",
    ]
    if "height" in d and "width" in d:
        parts.append(f"{d['height']}x{d['width']}")
    if "num_frames" in d:
        parts.append(f"{d['num_frames']} frames")
    return ", ".join(parts)


def model_card(pkg: Package, repo: str, license: str) -> str:
    """The model card (``README.md``): ModelScope's front matter, then what the package is."""
    m = pkg.manifest
    summary = summarize(pkg)
    base = m["model"]["base_id"]
    video = "num_frames" in m["call"]["defaults"]
    quality = (
        check_quality(pkg.read_json(QUALITY_REPORT), QUALITY_REPORT) if QUALITY_REPORT in m["files"] else {}
    )
    schemes = ", ".join(f"{n} layers {s}" for s, n in sorted(summary["schemes"].items())) or "none"
    lines = [
        "---",
        f"license: {license}",
        "frameworks:",
        "  - pytorch",
        "tasks:",
        f"  - {TASKS['video' if video else 'image']}",
        f"base_model: {json.dumps(base)}",
        "tags:",
        "  - sdkiln",
        "  - diffusion",
        *(["  - quantized"] if summary["schemes"] else []),
        "---",
        "",
        f"# {repo}",
        "",
        f"An sdkiln package of `{base}` ({m['model']['transformer_class']}, "
        f"{m['model']['dtype']}), made with recipe `{summary['recipe']}` by sdkiln {m['sdkiln_version']} on "
        f"{m['created']}.",
        "",
        f"Made for: {_deployment(m)}.",
        "",
        "## What was optimized",
        "",
        f"- Quantized layers: {summary['layers_quantized']} ({schemes}); kept in float: {summary['layers_float']}.",
        *(
            f"- Text encoder `{name}`: "
            + (", ".join(f"{n} layers {sc}" for sc, n in te["schemes"].items()) or "float")
            + f" ({te['decision']})."
            for name, te in summary["text_encoders"].items()
        ),
        f"- LoRA: `pipe.load_lora_weights` / `sdkiln run --lora` may target {sum(summary['lora_layers'].values())} "
        f"layers ({summary['lora_layers']['quantized']} quantized, as unmerged branches; "
        f"{summary['lora_layers']['float']} float), with strength control.",
        *(
            f"- Fused LoRA: `{f['file']}` at strength {f['strength']:g} (sha256 `{f['sha256']}`), merged into the "
            "float weights before quantization."
            for f in summary["fused_loras"]
        ),
    ]
    if summary["quantized_ratio"] is not None:
        lines.append(
            f"- Quantized weights: {summary['quantized_bytes']:,} bytes, {summary['quantized_ratio']:.3f}x their "
            "float32 size."
        )
    if summary["quality_target"]:
        lines.append(f"- Cache quality matched to {matched_text(summary['quality_target'], path=False)}.")
    if summary["cache"] is not None:
        c = summary["cache"]
        lines.append(
            f"- Cache schedule for {c['num_steps']} steps: {c['block_evaluations_ratio']:.3f}x the block "
            "evaluations of the uncached run."
        )
    if "sparse_attention" in summary["sections"]:
        lines.append("- Block-sparse attention: a per-layer plan (`attention/sparse_attention.json`).")
    if summary["attention_quant"] is not None:
        a = summary["attention_quant"]
        lines.append(
            f"- Quantized attention ({a['qk'].upper()} QK, {a['pv'].upper()} PV"
            f"{', MindIE SD blocks' if a['layout'] == 'mindie' else ''}): {a['quantized_fraction']:.0%} of "
            f"the attention layers' denoising steps, per layer and step (`{a['file']}`)."
        )
    lines += _memory_lines(summary["memory"])
    lines += ["", "Recipe steps:", ""]
    for step in m["recipe"]["steps"]:
        config = {k: v for k, v in step["config"].items() if k not in ("kind", "version")}
        lines.append(f"- `{step['config']['kind']}`: `{json.dumps(config, sort_keys=True)}`")
    if not m["recipe"]["steps"]:
        lines.append("- none (the base model as a package)")
    lines += ["", "## Quality", "", "```"]
    lines += quality_lines(quality, "measured by `sdkiln optimize` and stored in the package")
    lines += [
        "```",
        "",
        "Quality is measured against the base model on its own prompts at this deployment "
        "(`eval/quality.json`); `sdkiln eval` recomputes it.",
        "",
        "## Speed",
        "",
        "No speed is stored in a package: it depends on the machine and the kernels it loads onto. "
        "`sdkiln run` prints each image's time on yours; sdkiln's benchmarks (`bench/`) name the machine "
        "of every number they report.",
        "",
        "## Use",
        "",
        "```bash",
        "pip install 'sdkiln[hub]'",
        f"sdkiln run modelscope://{repo} --prompt 'a photo of a cat' --out cat.png",
        "```",
        "",
        "```python",
        "import sdkiln",
        f'pipe = sdkiln.load("modelscope://{repo}", digest="{pkg.digest}")',
        "```",
        "",
        f"The loader verifies every file against `{MANIFEST}` (sizes, sha256, no links, no pickles); its digest is "
        f"`{pkg.digest}`.",
        "",
        "## Licence",
        "",
        f"`{license}`, inherited from the base model `{base}`.",
        "",
    ]
    return "\n".join(lines)


def configuration(pkg: Package) -> dict[str, Any]:
    """ModelScope's ``configuration.json``: the framework and task, and where the package came from."""
    m = pkg.manifest
    return {
        "framework": "pytorch",
        "task": TASKS["video" if "num_frames" in m["call"]["defaults"] else "image"],
        "sdkiln": {"format": m["format"], "digest": pkg.digest, "base_id": m["model"]["base_id"]},
    }


def stage(pkg: Package, repo: str, license: str, where: Path) -> list[str]:
    """Fill the empty directory ``where`` with the package's verified bytes and the hub's files;
    returns the names."""
    (where / MANIFEST).write_bytes(pkg.manifest_bytes)
    for rel in pkg.manifest["files"]:
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        pkg.copy(rel, where / rel)
    files = [MANIFEST, *pkg.manifest["files"]]
    (where / CARD).write_text(model_card(pkg, repo, license), encoding="utf-8")
    (where / CONFIGURATION).write_text(json.dumps(configuration(pkg), indent=2) + "\n", encoding="utf-8")
    return sorted([*files, CARD, CONFIGURATION])


def publish(
    package: str | os.PathLike,
    repo: str,
    *,
    hub: str = "modelscope",
    private: bool = False,
    license: str | None = None,
    uploader: Uploader | None = None,
) -> Published:
    """Verify ``package``, stage it with its model card and upload it as ``repo`` (``ORG/NAME``).
    SdkilnError, one line, for a bad id or hub, a missing token or extra, or a failed upload."""
    if hub not in HUBS:
        raise SdkilnError(f"--hub {hub!r}: one of {', '.join(HUBS)}")
    if not valid_repo_id(repo):
        raise SdkilnError(f"--repo {repo!r}: a repository id is ORG/NAME (letters, digits, _ . -)")
    pkg = open_package(package)
    own = sorted(HUB_FILES & set(pkg.manifest["files"]))
    if own:
        raise SdkilnError(
            f"the package lists {own[0]} itself, which publishing writes: it cannot be published"
        )
    license = _license(pkg.manifest, license)
    token = os.environ.get(HUBS[hub]["token"], "").strip()
    if not token:
        raise SdkilnError(
            f"publishing to {hub} needs an access token in the environment variable {HUBS[hub]['token']}"
        )
    if uploader is None:
        require(HUBS[hub]["module"], extra=HUBS[hub]["extra"], what=f"publishing to {hub}")
        uploader = upload
    staged = Path(tempfile.mkdtemp(prefix="sdkiln-publish-"))  # never inside the package
    try:
        files = stage(pkg, repo, license, staged)
        try:
            url = uploader(staged, repo, hub, private, token)
        except Exception as exc:  # the hub client's failure, whatever it is: one line, token scrubbed
            message = " ".join(str(exc).replace(token, "***").split()) or type(exc).__name__
            raise SdkilnError(f"publishing {repo} to {hub} failed: {message}") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return Published(repo=repo, hub=hub, url=url, files=files, private=private)


def _memory_lines(table: dict[str, Any]) -> list[str]:
    """The model card's memory table: bytes per component, and the smallest device budget of each
    residency plan (estimates, ``docs/memory.md``)."""
    from sdkiln.runtime.memory.plan import gib

    lines = ["", "## Memory", "", "| component | on disk | in memory |", "|---|---|---|"]
    lines += [
        f"| {name} | {gib(c['disk_bytes'])} | {gib(c['memory_bytes'])} |"
        for name, c in table["components"].items()
    ]
    lines += [
        "",
        "Smallest device budget of each residency plan (`sdkiln run --memory-budget`; estimated, with "
        "10% headroom):",
        "",
        "| plan | estimated peak | budget from |",
        "|---|---|---|",
    ]
    lines += [
        f"| {n} | {gib(p['peak_bytes'])} | {gib(p['budget_bytes'])} |" for n, p in table["plans"].items()
    ]
    return lines
