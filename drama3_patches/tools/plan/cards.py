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
