"""Plot the loss of each step from `pipec run ... --json` output (docs/transformer.md):

pipec run 1f1b -D p=4 -D m=8 --model examples/hf_gpt2.py --nproc 4 --steps 50 --json > loss.json
python docs/img/loss_curve.py loss.json docs/img/hf-gpt2-loss.png
"""

import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, out: str) -> None:
    with open(src) as f:
        doc = json.load(f)
    steps = [s["step"] for s in doc["steps"]]
    losses = [s["loss"] for s in doc["steps"]]
    params = " ".join(f"{k}={v}" for k, v in doc["params"].items())
    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    ax.plot(steps, losses, marker=".", lw=1)
    ax.axhline(math.log(256), color="grey", ls=":", lw=1, label="ln 256 (uniform over bytes)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(f"examples/hf_gpt2.py on {doc['schedule']} ({params})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
