"""Load-time settings: how ``sdkiln.load`` runs a package on this machine. They are not recipe steps
(nothing about them is decided offline or stored in a package) and go to ``load(...)``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from sdkiln.errors import SdkilnError


def _from_dict(cls, data: Any):
    if not isinstance(data, dict):
        raise SdkilnError(f"{cls.__name__} must be an object, got {data!r}")
    if data.get("version", cls.version) != cls.version:
        raise SdkilnError(f"{cls.__name__} version {data.get('version')!r} is not supported")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names - {"version"}
    if unknown:
        raise SdkilnError(f"{cls.__name__} has unknown fields: {', '.join(sorted(unknown))}")
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the device mesh a package runs on (``sdkiln.runtime.parallel``, docs/parallel.md):
    the classifier-free-guidance branches across ``cfg`` ranks, the sequence across ``ulysses`` x
    ``ring`` ranks; they multiply to the world size torchrun launched. The mesh puts cfg outermost
    and Ulysses on adjacent ranks. ``split_text`` shards a joint-attention family's text tokens with
    its image tokens (diffusers' own ``_cp_plan``) instead of replicating them on every rank, which
    is exact; ``timeout_s`` bounds every collective, so a rank that died or hangs makes the others
    fail with an error instead of waiting forever."""

    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    split_text: bool = False
    timeout_s: float = 600.0
    version: ClassVar[int] = 2
    """2: split_text and timeout_s."""

    def __post_init__(self) -> None:
        for name in ("cfg", "ulysses", "ring"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SdkilnError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.cfg > 2:
            raise SdkilnError(f"ParallelConfig.cfg is 1 or 2 (the guidance branches), got {self.cfg}")
        if not isinstance(self.split_text, bool):
            raise SdkilnError(f"ParallelConfig.split_text is a bool, got {self.split_text!r}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not 0 < self.timeout_s < 1e6
        ):
            raise SdkilnError(
                f"ParallelConfig.timeout_s is a positive number of seconds, got {self.timeout_s!r}"
            )

    @property
    def sequence(self) -> int:
        """Ranks that share one sequence: ulysses x ring."""
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses * self.ring

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version} | dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ParallelConfig:
        return _from_dict(cls, data)


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FUSIONS = ("rms_norm", "adaln", "rope", "gelu_tanh", "gate_add", "norm_quantize")
"""The compile backend's fusion patterns (``sdkiln.runtime.compile.patterns``), one switch each."""


@dataclass(frozen=True)
class CompileConfig:
    """How ``sdkiln.load`` compiles the transformer (``sdkiln.runtime.compile``).

    ``backend="sdkiln"`` (the default) is sdkiln's torch.compile backend: the ``fusions`` named
    here (all by default) replace diffusers' subgraphs with fused ``sdkiln`` ops, then Inductor
    compiles; any other name is passed to torch.compile as it is ("inductor", "eager", ...), with
    ``mode``. ``cuda_graphs`` captures CUDA graphs (one per input shape; a new shape captures
    again), as ``mode="reduce-overhead"`` does. ``regional`` compiles each repeated block (one graph
    per block kind, diffusers' ``_repeated_blocks``) instead of the whole transformer: a cold start
    compiles a few blocks, not 57. ``fullgraph`` and ``dynamic`` are torch.compile's. ``cache_dir``
    is where compiled code is kept for the next process (``sdkiln.runtime.compile.cache``; default
    ``~/.cache/sdkiln/compile``), one folder per package digest, device and torch version. The runtime's
    hooks decide outside the compiled region, so quantized layers and a cache schedule compile
    without graph breaks; a guarded cache schedule breaks once per reuse step (its check reads the
    device), so ``fullgraph=True`` refuses it."""

    backend: str = "sdkiln"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    fusions: tuple[str, ...] = FUSIONS
    cuda_graphs: bool = False
    regional: bool = False
    cache_dir: str | None = None
    version: ClassVar[int] = 2
    """2: the sdkiln backend by default, with fusions, cuda_graphs and regional."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise SdkilnError(
                f"CompileConfig.backend must name a torch.compile backend, got {self.backend!r}"
            )
        if self.mode not in COMPILE_MODES:
            raise SdkilnError(f"CompileConfig.mode must be one of {COMPILE_MODES}, got {self.mode!r}")
        if not isinstance(self.fullgraph, bool) or self.dynamic not in (None, True, False):
            raise SdkilnError("CompileConfig.fullgraph is a bool and dynamic a bool or None")
        if not isinstance(self.cuda_graphs, bool) or not isinstance(self.regional, bool):
            raise SdkilnError("CompileConfig.cuda_graphs and regional are bools")
        if isinstance(self.cache_dir, os.PathLike):
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise SdkilnError(f"CompileConfig.cache_dir is a directory path, got {self.cache_dir!r}")
        fusions = tuple(self.fusions) if isinstance(self.fusions, list | tuple) else None
        if fusions is None or any(f not in FUSIONS for f in fusions):
            raise SdkilnError(
                f"CompileConfig.fusions is a list of {', '.join(FUSIONS)}; got {self.fusions!r}"
            )
        object.__setattr__(self, "fusions", tuple(f for f in FUSIONS if f in fusions))
        if self.backend != "sdkiln" and (self.cuda_graphs or fusions != FUSIONS):
            raise SdkilnError(
                "CompileConfig.fusions and cuda_graphs are the sdkiln backend's; with backend="
                f"{self.backend!r} use mode='reduce-overhead' for CUDA graphs"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version} | dataclasses.asdict(self) | {"fusions": list(self.fusions)}

    @classmethod
    def from_dict(cls, data: Any) -> CompileConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file and its strength, as ``--lora FILE[:STRENGTH]`` gives them (``sdkiln run``: a
    runtime branch, ``sdkiln optimize``: fused into the float weights before calibration)."""

    path: str
    strength: float = 1.0

    def __post_init__(self) -> None:
        if not str(self.path).endswith(".safetensors"):
            raise SdkilnError(f"--lora {self.path}: a LoRA is read from a .safetensors file (no pickles)")
        if (
            not isinstance(self.strength, int | float)
            or self.strength != self.strength
            or abs(self.strength) > 1e6
        ):
            raise SdkilnError(
                f"--lora {self.path}: the strength must be a finite number, got {self.strength!r}"
            )

    @classmethod
    def parse(cls, text: str) -> LoraFile:
        """``FILE`` or ``FILE:STRENGTH`` (the strength after the last colon, when it is a number)."""
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                return cls(head, float(tail))
            except ValueError:
                pass
        return cls(text)


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20}
_UNITS |= {"G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """``16G``, ``16GB``, ``16GiB`` (all 2**30), ``512M``, ``1.5G`` or a plain byte count."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper().replace(" ", "")
        number = s.rstrip("KMGTIB")
        unit = s[len(number) :]
        try:
            value = int(float(number) * _UNITS[unit])
        except (KeyError, ValueError):
            raise SdkilnError(
                f"a memory size is a number with K, M, G or T (16G, 512M), got {text!r}"
            ) from None
    if value <= 0:
        raise SdkilnError(f"a memory size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class MemoryConfig:
    """Run a package within ``device_budget`` bytes of device memory (``sdkiln.runtime.memory``).

    A planner picks the first residency plan whose estimated peak fits, in this order: everything
    resident; the text encoders visiting the device only while they encode; the VAE visiting too;
    the transformer's blocks streamed from host memory in groups of ``4``, ``2``, then ``1`` blocks
    (the next group prefetched on a side stream on CUDA); where the VAE can tile, each plan that
    lets it visit is followed by the same plan with the VAE decoding in tiles (``+tiled``: not bit
    for bit the untiled decode). A budget no plan fits is refused with the bytes the smallest plan
    needs. ``plan`` forces one plan by name (``resident``, ``encoders``, ``encoders+vae``,
    ``encoders+vae+tiled``, ``blocks:N``, ``blocks:N+tiled``), the budget then only checked against
    it when given."""

    device_budget: int | str | None = None
    plan: str | None = None
    prefetch: bool = True
    version: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if self.device_budget is not None:
            object.__setattr__(self, "device_budget", parse_bytes(self.device_budget))
        if self.device_budget is None and self.plan is None:
            raise SdkilnError("MemoryConfig needs a device_budget (16G) or a plan")
        if self.plan is not None and not _plan_name_ok(self.plan):
            raise SdkilnError(
                "MemoryConfig.plan is resident, encoders, encoders+vae, encoders+vae+tiled, blocks:N or "
                f"blocks:N+tiled (N >= 1), got {self.plan!r}"
            )
        if not isinstance(self.prefetch, bool):
            raise SdkilnError("MemoryConfig.prefetch is a bool")

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version} | dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> MemoryConfig:
        return _from_dict(cls, data)


def _plan_name_ok(name: Any) -> bool:
    if name in ("resident", "encoders", "encoders+vae", "encoders+vae+tiled"):
        return True
    head, _, n = str(name).removesuffix("+tiled").partition(":")
    return head == "blocks" and n.isdigit() and int(n) >= 1
