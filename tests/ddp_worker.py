"""Run under torchrun by test_train.py: train a config on prepared shards.

argv: cfg.json shards_dir out_dir [--stop-after N] [--resume]"""

import argparse

from prismlm import RunConfig
from prismlm.data.shards import load_shards
from prismlm.train import train

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cfg")
    ap.add_argument("shards")
    ap.add_argument("out")
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    train(
        RunConfig.from_json(args.cfg),
        args.out,
        shards=load_shards(args.shards),
        progress=False,
        stop_after=args.stop_after,
        resume=args.resume,
    )
