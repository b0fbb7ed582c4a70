"""Writing `.pipe` source: the pieces every writer of explicit per-rank orders shares (`pipec import`,
`pipec synth`), so their files read alike."""

from __future__ import annotations

from collections.abc import Sequence


def op_text(kind: str, mb: str, stage: int, multi: bool) -> str:
    """One op call; `stage:` only when the rank holds several stages."""
    return f"{kind}({mb}, stage: {stage})" if multi else f"{kind}({mb})"


def rank_block(bodies: Sequence[Sequence[str]]) -> list[str]:
    """`rank r { ... }` holding each rank's lines, one `if r == ...` branch per rank (none for one rank)."""
    lines = ["    rank r {"]
    for r, body in enumerate(bodies):
        if len(bodies) == 1:
            lines += ["        " + x for x in body]
            continue
        lines.append(("        if" if r == 0 else "        } elif") + f" r == {r} {{")
        lines += ["            " + x for x in body]
    if len(bodies) > 1:
        lines.append("        }")
    lines.append("    }")
    return lines
