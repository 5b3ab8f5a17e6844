"""The residency planner: which components stay on the device, which visit it, whether the
transformer's blocks stream, for a device budget.

Pure arithmetic over :class:`Sizes` (bytes per component, per transformer block, and activation
estimates), so it plans real models from their configs without building them. Plans, cheapest in
time first; the first whose estimated peak fits the budget is chosen:

* ``resident``: every component on the device.
* ``encoders``: the text encoders visit the device while they encode (one at a time), then leave.
* ``encoders+vae``: the VAE visits too, while it encodes or decodes.
* ``blocks:N`` (N = 4, 2, 1): also the transformer's block lists stream from host memory, N blocks at
  a time; with prefetch, the next group is on the device while one computes (two groups resident).

Where the VAE can decode in tiles (diffusers' ``enable_tiling``) and the deployment's size is larger
than a tile, ``encoders+vae+tiled`` follows ``encoders+vae`` and each ``blocks:N+tiled`` follows
the streamed plans: the same residency with the VAE decoding tiles of ``sizes.VAE_TILE`` pixels,
blended where they overlap. Tiled plans come after the exact ones they extend: a tiled decode is not
bit for bit the untiled one (docs/memory.md states how far it is).

A peak is the resident bytes plus the largest visitor at its moment: an encoder with its activations,
a transformer call's activations (with the streamed groups), or the VAE with its decode activations.
A plan fits when its peak is at most the budget less ``HEADROOM`` (10%) of it. A budget below the
smallest plan is refused with the bytes that plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sdkiln.errors import SdkilnError

GROUPS = (4, 2, 1)
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """A pipeline's bytes as the planner sees them (``runtime.memory.sizes`` measures a loaded one)."""

    components: dict[str, int]
    """Every torch component: name -> bytes of its parameters and buffers (a transformer whole)."""
    encoders: tuple[str, ...] = ()
    vae: tuple[str, ...] = ()
    transformers: tuple[str, ...] = ("transformer",)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    """Transformer name -> bytes of each block of its block lists, in the order they run."""
    activations: int = 0
    """One transformer call's peak activation bytes (estimate)."""
    encode_activations: int = 0
    decode_activations: int = 0
    decode_tiled_activations: int = 0
    """The VAE decode's activations when it decodes in tiles; 0: no tiled plan (the VAE cannot tile, or
    the deployment's size is one tile)."""


@dataclass(frozen=True)
class Plan:
    name: str
    visiting: tuple[str, ...]
    blocks_per_group: int | None
    peak: int
    """Estimated peak device bytes."""
    budget: int | None
    prefetch: bool = True
    vae_tiled: bool = False
    """The VAE decodes in tiles (``+tiled``)."""

    def describe(self, sizes: Sizes) -> str:
        """The plan in a few lines: what stays, what visits, what streams, the estimate."""
        resident = []
        for c in sizes.components:
            if c in self.visiting:
                continue
            if self.blocks_per_group and sizes.blocks.get(c):
                resident.append(f"{c} {gib(sizes.components[c] - sum(sizes.blocks[c]))} outside its blocks")
            else:
                resident.append(f"{c} {gib(sizes.components[c])}")
        lines = [
            f"memory plan {self.name}: estimated peak {gib(self.peak)}"
            + ("" if self.budget is None else f" of a {gib(self.budget)} budget")
            + " (activations estimated)",
            f"  on the device: {', '.join(resident) or 'nothing'}",
        ]
        if self.visiting:
            lines.append(f"  visiting while they run: {', '.join(self.visiting)}")
        if self.vae_tiled:
            lines.append(
                "  the VAE decodes in tiles (blended where they overlap: not bit for bit the untiled decode)"
            )
        if self.blocks_per_group:
            n = sum(len(b) for b in sizes.blocks.values())
            lines.append(
                f"  transformer blocks streamed from host memory, {self.blocks_per_group} at a time "
                f"({n} blocks{', the next group prefetched' if self.prefetch else ''})"
            )
        return "\n".join(lines)


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


Candidate = tuple[str, tuple[str, ...], int | None, bool]
"""A plan's name, its visiting components, its blocks per group (None: resident), its tiled decode."""


def candidates(sizes: Sizes, prefetch: bool = True) -> list[Candidate]:
    tiled = bool(sizes.vae and sizes.decode_tiled_activations)
    out: list[Candidate] = [("resident", (), None, False)]
    if sizes.encoders:
        out.append(("encoders", sizes.encoders, None, False))
    if sizes.vae:
        out.append(("encoders+vae", sizes.encoders + sizes.vae, None, False))
    if tiled:
        out.append(("encoders+vae+tiled", sizes.encoders + sizes.vae, None, True))
    if any(sizes.blocks.values()):
        out += [(f"blocks:{g}", sizes.encoders + sizes.vae, g, False) for g in GROUPS]
        if tiled:
            out += [(f"blocks:{g}+tiled", sizes.encoders + sizes.vae, g, True) for g in GROUPS]
    return out


def peak(
    sizes: Sizes, visiting: tuple[str, ...], group: int | None, prefetch: bool = True, tiled: bool = False
) -> int:
    """Estimated peak device bytes of one plan (module docstring)."""
    streamed = {t: b for t, b in sizes.blocks.items() if b} if group else {}
    resident = 0
    for name, size in sizes.components.items():
        if name in visiting:
            continue
        resident += size - sum(streamed.get(name, []))
    groups = 0
    for blocks in streamed.values():
        windows = [sum(blocks[i : i + group]) for i in range(0, len(blocks), group)]
        largest = sorted(windows, reverse=True)[: 2 if prefetch else 1]
        groups = max(groups, sum(largest))
    moments = [groups + sizes.activations]  # a transformer call (with its streamed groups)
    decode = sizes.decode_tiled_activations if tiled else sizes.decode_activations
    for names, extra in ((sizes.encoders, sizes.encode_activations), (sizes.vae, decode)):
        for name in names:  # an encoder encoding, the VAE decoding: with its own bytes when it visits
            moments.append(extra + (sizes.components[name] if name in visiting else 0))
    return resident + max(moments)


HEADROOM = 0.10
"""The part of a budget no plan may use: the allocator's fragmentation, the kernels' workspaces and
what the estimates miss."""


def plan(
    sizes: Sizes,
    budget: int | None,
    forced: str | None = None,
    prefetch: bool = True,
    headroom: float = HEADROOM,
) -> Plan:
    """The first plan (module docstring) whose peak fits ``budget`` less ``headroom`` of it, or
    ``forced`` by name."""
    options = candidates(sizes, prefetch)
    usable = None if budget is None else int(budget * (1 - headroom))
    kept = "" if not headroom else f" ({gib(usable or 0)} after {headroom:.0%} headroom)"
    if forced is not None:
        base = forced.removesuffix("+tiled")
        group = int(base.partition(":")[2]) if base.startswith("blocks:") else None
        lookup = ("blocks:1" if group else base) + forced[len(base) :]
        chosen = [o for o in options if o[0] == lookup]
        if not chosen:
            names = ", ".join(o[0] for o in options)
            raise SdkilnError(f"memory plan {forced!r} does not apply to this pipeline; it has {names}")
        _, visiting, _, tiled = chosen[0]
        name = forced
        p = Plan(
            name, visiting, group, peak(sizes, visiting, group, prefetch, tiled), budget, prefetch, tiled
        )
        if usable is not None and p.peak > usable:
            raise SdkilnError(
                f"memory plan {name} needs about {gib(p.peak)} of device memory, more than the {gib(budget)} "
                f"budget{kept}"
            )
        return p
    if budget is None:
        raise SdkilnError("a memory plan needs a device budget or a plan name")
    estimates = [
        (name, visiting, group, tiled, peak(sizes, visiting, group, prefetch, tiled))
        for name, visiting, group, tiled in options
    ]
    for name, visiting, group, tiled, need in estimates:
        if need <= usable:
            return Plan(name, visiting, group, need, budget, prefetch, tiled)
    name, *_, need = min(estimates, key=lambda e: e[4])
    raise SdkilnError(
        f"no memory plan fits a {gib(budget)} device budget{kept}: the smallest, {name}, needs about {gib(need)}"
    )
