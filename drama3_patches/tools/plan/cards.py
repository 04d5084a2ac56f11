"""Accelerator cards known by name to ``drama3-patches plan``."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class Card:
    name: str
    memory_gib: float
    mxfp8: bool  # FP8 experts can stay FP8 on the device (no bfloat16 expansion)
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


CARDS = {
    c.name.lower(): c
    for c in (
        Card("910B1", 64, False),
        Card("910B2", 64, False),
        Card("910B3", 64, False),
        Card("910B4", 32, False),
        # Announced Ascend 950 figures; confirm the memory with `npu-smi info`
        # and pass --card-gib when it differs.
        Card("950PR", 128, True, "announced specification"),
        Card("950DT", 144, True, "announced specification"),
    )
}


class UnknownCard(ValueError):
    pass


def lookup(name: str | None, memory_gib: float | None = None, mxfp8: bool | None = None) -> Card:
    """A card by name, or a custom one from ``--card-gib`` (name optional then)."""
    if name is None:
        if memory_gib is None:
            raise UnknownCard("give --card NAME or --card-gib GIB")
        return Card("custom", float(memory_gib), bool(mxfp8))
    card = CARDS.get(name.lower())
    if card is None:
        if memory_gib is not None:
            return Card(name, float(memory_gib), bool(mxfp8))
        known = ", ".join(c.name.lower() for c in CARDS.values())
        raise UnknownCard(f"unknown card {name!r}; known: {known}; for another card give --card-gib GIB")
    if memory_gib is not None or mxfp8 is not None:
        card = Card(card.name, float(memory_gib if memory_gib is not None else card.memory_gib),
                    card.mxfp8 if mxfp8 is None else bool(mxfp8), card.note)
    return card


# Speed figures for `plan --time`, each from a public source named beside it. Huawei publishes
# memory size and the Atlas servers' interconnect, but no per-SKU HBM bandwidth or float32 rate
# for the 910B: those are the figures third-party write-ups repeat, and disagree on (400 GB/s to
# 1.6 TB/s for HBM). Every one is overridable (--card-hbm-gbps, --link-gbps); the first card run
# (`plan --time --calibrate validate-out/report.json`) replaces the model's guesses by measurements.
@dataclass(frozen=True)
class Speed:
    hbm_gbps: float          # HBM bandwidth, GB/s (10^9 bytes)
    bf16_tflops: float       # dense bfloat16/float16 matrix throughput
    fp32_tflops: float       # float32 (the DAC decoder's default dtype)
    link_gbps: float         # card-to-card link per direction between two cards of a TP group, GB/s
    link_latency_us: float   # one small collective's latency; 0 where no public figure was found
    sources: tuple = ()


_910B_SOURCES = (
    "HBM 64 GB HBM2e at about 1.6 TB/s, FP16 313 TFLOPS (910B3) to ~400 TFLOPS (910B1): third-party "
    "specification summaries of the Ascend 910B (e.g. Huawei Ascend 910B articles on boardor.com and "
    "oryoy.com, which also quote 400 GB/s and 1.2 TB/s; Huawei publishes no per-SKU bandwidth)",
    "float32: no public figure for the 910B's cube unit; taken as a quarter of the FP16 rate (an assumption)",
    "HCCS: Atlas 800T A2 (8 x 910B, full mesh), 56 GB/s per card-to-card link (392 GB/s over 7 links), "
    "Huawei Atlas 800T A2 product specification; no public collective latency (0 here)",
)
_950_SOURCES = (
    "Ascend 950PR: HiBL 1.0, 128 GB at 1.6 TB/s; 950DT: HiZQ 2.0, 144 GB at 4 TB/s; FP8/MXFP8 1 PFLOPS; "
    "interconnect 2 TB/s: Huawei Connect 2025 announcement (18 September 2025) as reported publicly",
    "bfloat16 taken as half the FP8 rate and float32 a quarter of bfloat16 (assumptions: not announced)",
)

SPEEDS = {
    "910b1": Speed(1600, 400, 100, 56, 0.0, _910B_SOURCES),
    "910b2": Speed(1600, 376, 94, 56, 0.0, _910B_SOURCES),
    "910b3": Speed(1600, 313, 78, 56, 0.0, _910B_SOURCES),
    "910b4": Speed(800, 280, 70, 56, 0.0, _910B_SOURCES),
    "950pr": Speed(1600, 500, 125, 2000, 0.0, _950_SOURCES),
    "950dt": Speed(4000, 500, 125, 2000, 0.0, _950_SOURCES),
}


def speed(card: Card) -> Speed | None:
    """The card's speed figures by its name, or None for a card the table does not know."""
    return SPEEDS.get(card.name.lower())
