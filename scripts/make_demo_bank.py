"""Make the bank ``prism demo`` ships (src/prismlm/data/builtin/banks/): the demo's own recipe trained here for
--steps bank steps from a seeded bank, then saved with how it was made (``prismlm.app.demos.save_demo_bank``).

    python scripts/make_demo_bank.py --steps 300 --out runs/demo-bank     # ~15 min on 2 idle cores
    python scripts/make_demo_bank.py --from-run runs/demo-bank             # only save an existing run's bank
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prismlm.app.demos import DEMO_BANK, demo, save_demo_bank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="bank steps trained from the seeded bank")
    p.add_argument("--out", type=Path, default=Path("runs/demo-bank"), help="the demo run folder it trains")
    p.add_argument("--from-run", type=Path, help="a finished `prism demo --steps N` run: save its bank only")
    p.add_argument("--bank", type=Path, default=DEMO_BANK, help="where the bank is written")
    args = p.parse_args()
    run = args.from_run
    if run is None:
        demo(steps=args.steps, out=args.out)
        run = args.out
    path = save_demo_bank(run, args.bank, reproduce=f"python scripts/make_demo_bank.py --steps {args.steps}")
    print(f"demo bank: {path} ({path.stat().st_size / 1e6:.1f} MB) from {run}")


if __name__ == "__main__":
    main()
