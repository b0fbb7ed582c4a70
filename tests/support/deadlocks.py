"""Schedule texts that deadlock, for the tests that explain, draw or refuse them."""

from __future__ import annotations

DEADLOCK_1F1B = """\
# 1F1B, p = 2, where rank 0 runs B(0) before F(1): rank 1 needs F(1) before it sends B(0)'s gradient.
schedule "1f1b-deadlock" (p: int = 2, m: int = 4) {
    stages p
    ops F, B
    rank r {
        if r == 0 {
            F(0)  B(0)  F(1)  B(1)  F(2)  B(2)  F(3)  B(3)
        } else {
            F(0)  F(1)  B(0)  B(1)  F(2)  B(2)  F(3)  B(3)
        }
    }
}
"""
