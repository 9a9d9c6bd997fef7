"""Run under torchrun by test_train.py: train a config on prepared shards (argv: cfg.json shards_dir out_dir)."""

import sys

from prismlm import RunConfig
from prismlm.data.shards import load_shards
from prismlm.train import train

if __name__ == "__main__":
    cfg_path, shards_dir, out_dir = sys.argv[1:4]
    train(RunConfig.from_json(cfg_path), out_dir, shards=load_shards(shards_dir), progress=False)
