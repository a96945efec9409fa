"""Make docs/plan-report.html and its screenshot docs/plan-report.png (the README's picture).

    python docs/make_report.py            # needs Debian's `chromium` on PATH for the PNG

The plan: the example GPT (4 layers) cut into 4 stages for A100s, priced analytically.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import replica  # noqa: E402
from replica.viz.report import visualize  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from replica.partition.trace import trace  # noqa: E402


def gpt_plan() -> tuple[replica.Plan, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32))
    idx = torch.randint(0, 256, (8, 32))  # (B, T)
    plan = replica.plan(model, (idx,), num_stages=4, device="a100-80gb", cost="analytic")
    return plan, trace(model, (idx,)).graph


def screenshot(html: Path, png: Path, *, width: int = 1400, height: int = 1800) -> None:
    """Render ``html`` in headless Chromium and save a ``width`` × ``height`` screenshot."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium is not on PATH: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={width},{height}",
                        html.resolve().as_uri()], check=True, capture_output=True, timeout=120)


def main() -> None:
    plan, graph = gpt_plan()
    html = visualize(plan, ROOT / "docs" / "plan-report.html", graph=graph)
    print(f"wrote {html}")
    png = ROOT / "docs" / "plan-report.png"
    screenshot(html, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
