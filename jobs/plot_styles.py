"""How each retrieval method is drawn in a run's plots (jobs/report.py): colour by family, marker and dash by
method, so that every method of a run has its own line."""

from __future__ import annotations

from typing import Any

from memgas.pipeline.methods import METHODS

#: colour map per method family (shades of one hue: the family reads at a glance) and the markers and dashes
#: that tell the methods of a family apart; names the registry does not know (an old run) are drawn in grey
FAMILY_COLOURS: dict[str, str] = {"memgas": "Blues", "justmem": "Oranges", "memgas-cards": "Greens", "other": "Greys"}
MARKERS: tuple[str, ...] = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")
DASHES: tuple[str, ...] = ("-", "--", "-.", ":")


def method_styles(methods: list[str]) -> dict[str, dict[str, Any]]:
    """Per method, the ``color``, ``marker`` and ``linestyle`` its line is drawn with: the colour by family
    (MemGAS, JustMem, memgas-cards), and within a family a shade, a marker and a dash per method, so that no two
    methods of a run share a style (matplotlib's default cycle has ten colours for the demo's 15 methods)."""
    from matplotlib import colormaps  # here: matplotlib loads only when a plot is drawn

    families: dict[str, list[str]] = {}
    for m in methods:
        fam = METHODS[m].family if m in METHODS else "other"
        families.setdefault(fam if fam in FAMILY_COLOURS else "other", []).append(m)
    styles: dict[str, dict[str, Any]] = {}
    for fam, members in families.items():
        cmap = colormaps[FAMILY_COLOURS[fam]]
        for i, m in enumerate(members):
            # shades from 0.95 down to 0.45: lighter ends of these maps are near white and vanish on the page
            shade = 0.95 - 0.5 * i / max(1, len(members) - 1)
            styles[m] = {"color": cmap(shade), "marker": MARKERS[i % len(MARKERS)],
                         "linestyle": DASHES[i % len(DASHES)]}
    return styles
