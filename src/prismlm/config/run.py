"""``RunConfig``: everything a training run needs, built from a preset, a JSON file or dotted overrides."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prismlm.config.model import ModelConfig, PrototypeConfig
from prismlm.config.overrides import convert, field_type
from prismlm.config.presets import PRESETS
from prismlm.config.training import DataConfig, LossConfig, TrainConfig
from prismlm.config.validation import from_dict
from prismlm.errors import ConfigError

if TYPE_CHECKING:  # only for annotations: importing artifacts loads torch, the config stays light
    from prismlm.artifacts import JSON


@dataclass
class RunConfig:
    """Everything a training run needs; saved resolved in every run folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str | None = None
    """Name of the preset this config started from (informational)."""
    source: dict[str, object] | None = None
    """What a retrofit's weights were loaded from, when a file: for a GGUF ``kind``, ``path``, ``sha256``,
    ``quantization``, ``architecture``, ``tensor_types``, ``name`` (``prismlm.model.gguf.SourceInfo``);
    copied into every checkpoint's manifest."""

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RunConfig:
        return from_dict(cls, data, "config")

    @classmethod
    def from_json(cls, path: str | Path) -> RunConfig:
        """A config file (e.g. ``RUN/config.json``); ``ConfigError`` naming the file if it is missing or
        not valid JSON."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config file at {path}", fix="pass a RunConfig JSON (e.g. RUN/config.json)")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, JSON]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_name(cls, name: str) -> RunConfig:
        """A named preset: ``tiny``, ``cpu-small``, ``gpt2-124m``, ``gpt2-medium``, ``gpt2-large``, ``xl-1.6b``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        cfg = cls.from_dict(PRESETS[name])
        cfg.preset = name
        return cfg

    def override(self, dotted: Mapping[str, object]) -> RunConfig:
        """Return a copy with ``{"train.lr": 1e-3, "model.prototypes": None}``-style overrides applied."""
        data: dict[str, object] = asdict(self)
        for key, value in dotted.items():
            parts = key.split(".")
            node = data
            for p in parts[:-1]:
                child = node.get(p)
                if child is None and p in node and p == "prototypes":
                    child = node[p] = asdict(PrototypeConfig())
                if not isinstance(child, dict):
                    raise ConfigError(f"override {key!r}: {p!r} is not a config section")
                node = child
            if parts[-1] not in node:
                raise ConfigError(f"override {key!r}: unknown key {parts[-1]!r}; valid: {sorted(node)}")
            node[parts[-1]] = value
        return RunConfig.from_dict(data)

    def override_strings(self, pairs: list[str] | tuple[str, ...]) -> RunConfig:
        """``["train.lr=1e-3", "model.prototypes=null"]`` → a validated copy. Each
        value is converted to the declared type of its field (int, float, bool, str, a Literal choice,
        or ``null``/``none`` for an optional field); a value that does not convert raises ``ConfigError``
        naming the key, the value and the type expected."""
        return self.override(parse_overrides(pairs))

    def dense(self) -> RunConfig:
        """The matched dense baseline: same everything, no prototype head."""
        return self.override({"model.prototypes": None})


def parse_overrides(pairs: list[str] | tuple[str, ...]) -> dict[str, object]:
    """``["train.lr=1e-3", "model.prototypes=null"]`` → ``{"train.lr": 0.001, "model.prototypes": None}``,
    each value converted to its field's declared type (see ``RunConfig.override_strings``)."""
    out: dict[str, object] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"`overrides` expects KEY=VALUE, got {pair!r}", param="overrides")
        key, raw = (x.strip() for x in pair.split("=", 1))
        hint = field_type(RunConfig, key)
        if hint is None:  # unknown key: let override() name the valid ones
            out[key] = raw
            continue
        out[key] = convert(key, raw, hint)
    return out
