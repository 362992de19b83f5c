"""Measuring what a compiled program communicates: collectives and bytes, from XLA's HLO."""

from ._collectives import (
    Collective as Collective,
    CollectiveStats as CollectiveStats,
    collective_stats as collective_stats,
)
