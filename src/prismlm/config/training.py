"""The training run's configs: the PRISM objective's weights, the corpus and tokenizer, the optimiser."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from prismlm.config.validation import check, valid_device


@dataclass
class LossConfig:
    """Weights of the PRISM objective L = CE + λ_rec REC + λ₁ R1 + λ₂ R2 (spec §2)."""

    lambda_rec: float = 1.0
    """Weight of REC = mean ‖r‖²/‖z‖² (residual energy share)."""
    lambda_r1: float = 0.1
    """Weight of R1 = mean over prototypes of min over batch tokens (1 − cos(p_i, z_t))."""
    lambda_r2: float = 0.1
    """Weight of R2 = mean over tokens of min over prototypes (1 − cos(z_t, p_i))."""
    lambda_proto_kl: float = 0.0
    """Weight of KL(p ‖ softmax(W ẑ)): the prototype-only prediction (the logits of the reconstruction ẑ
    alone, without the residual) distilled toward the model's distribution p (the source model's in
    stage 2 on stored activations). 0 (default) leaves the paper's objective; > 0 asks the bank (and in
    stage 2 the unfrozen blocks) to carry the prediction, not only the form of z. Used by the retrofit's
    bank stage on stored z and stage 2 on stored boundary activations (``prismlm.train.stage2``)."""
    proto_kl_rows: int = 1024
    """Retrofit bank stage on stored z: the prototype-only KL is computed on at most this many evenly spaced
    rows of each micro-batch. Why: it costs two (rows × V) vocabulary products and their gradient (a 49k
    vocabulary: ~0.6 GB and most of a step's time at 1,024 rows); the other terms see every row."""
    kl_candidates: int = 0
    """The KL terms of the stages on stored activations (the bank stage's prototype-only KL, stage 2's KL to
    the source and its prototype-only KL): 0 (default) over the whole vocabulary; c > 0 over the union,
    within each micro-batch, of every row's c most likely tokens under the reference distribution, both
    distributions renormalised on that set. Why: with a 49k vocabulary the (rows × V) products dominate a
    step; on the union they shrink to (rows × |union|). Probability outside the union is not constrained by
    the loss, so measure held-out CE and KL over the whole vocabulary (the validation lines do)."""
    warmup_steps: int = 0
    """The three prototype weights ramp linearly from 0 to their value over this many optimizer
    steps, so the backbone first learns language before it is pulled onto the prototypes."""

    def __post_init__(self) -> None:
        for name in ("lambda_rec", "lambda_r1", "lambda_r2", "lambda_proto_kl"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        check(self.proto_kl_rows >= 1, f"proto_kl_rows must be >= 1, got {self.proto_kl_rows}")
        check(
            self.kl_candidates >= 0, f"kl_candidates must be >= 0 (0: the whole vocabulary), got {self.kl_candidates}"
        )

    def weights_at(self, step: int) -> dict[str, float]:
        """Loss weights at an optimizer step (warm-up applied); CE always has weight 1."""
        ramp = 1.0 if self.warmup_steps == 0 else min(1.0, (step + 1) / self.warmup_steps)
        weights = {"ce": 1.0, "rec": self.lambda_rec * ramp, "r1": self.lambda_r1 * ramp, "r2": self.lambda_r2 * ramp}
        if self.lambda_proto_kl:  # absent at 0: the weights of every earlier run stay what they were
            weights["proto_kl"] = self.lambda_proto_kl * ramp
        return weights


@dataclass
class DataConfig:
    """Which corpus and tokenizer, and how token shards are built (see ``prismlm.data``)."""

    corpus: str = "builtin"
    """``builtin`` (Gutenberg + State of the Union, offline), a folder/glob/file of .txt/.jsonl/.parquet,
    or ``hf:NAME[:CONFIG][@SPLIT]`` for a Hugging Face dataset (needs a network)."""
    tokenizer: str = "bpe-8192"
    """``bpe-N`` trains a byte-level BPE with N tokens on the train split; ``gpt2`` is the real GPT-2
    BPE (offline); ``hf:NAME`` any Hugging Face tokenizer; or a path to a saved tokenizer."""
    text_field: str = "text"
    """Field holding the text in .jsonl/.parquet/HF corpora."""
    val_fraction: float = 0.02
    """Share of documents (by a stable hash of the document id) held out for validation."""
    seed: int = 0
    """Seed of the train/validation split hash."""
    max_docs: int | None = None
    """Use only the first N documents (smoke tests)."""
    max_chars_per_doc: int | None = None
    """Truncate each document to N characters (smoke tests)."""
    data_dir: str | None = None
    """Where shards are written; default ``$PRISM_DATA`` or ``~/.cache/prismlm/data``."""
    streaming: bool = False
    """Stream the corpus through training instead of tokenising it into shards first: documents are read
    lazily (HF ``datasets`` streaming, parquet by row batches, jsonl by lines), tokenised on the fly, packed
    and shuffled in a bounded buffer; checkpoints record the exact stream position. Needs a fixed tokenizer
    (``gpt2``, ``hf:NAME`` or a saved one), not ``bpe-N``."""
    shuffle_buffer: int = 1024
    """Streaming: sequences held in the shuffle buffer (memory and checkpoint size grow with it)."""
    stream_val_tokens: int = 262144
    """Streaming: validation tokens materialised (the first validation-split documents up to this many)."""

    def __post_init__(self) -> None:
        check(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        check(self.shuffle_buffer >= 1, f"shuffle_buffer must be >= 1, got {self.shuffle_buffer}")
        check(self.stream_val_tokens >= 1, f"stream_val_tokens must be >= 1, got {self.stream_val_tokens}")
        check(
            not (self.streaming and re.match(r"^bpe(?:[-:]\d+)?$", self.tokenizer)),
            f"data.streaming needs a fixed tokenizer, but data.tokenizer={self.tokenizer!r} must be trained on "
            "the corpus first: use gpt2, hf:NAME or a saved tokenizer folder",
        )
        check(self.max_docs is None or self.max_docs >= 1, "max_docs must be >= 1")
        check(self.max_chars_per_doc is None or self.max_chars_per_doc >= 1, "max_chars_per_doc must be >= 1")


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing."""

    batch_size: int = 16
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (per process). Global batch =
    batch_size × grad_accum × world_size sequences."""
    max_steps: int = 1000
    """Optimizer steps to train for."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    warmup_steps: int = 50
    """Linear learning-rate warm-up steps."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """``cosine``: warm-up then cosine decay; ``wsd``: warm-up, stable, then linear decay over the last
    ``decay_fraction`` of steps."""
    decay_fraction: float = 0.2
    """Share of steps spent decaying in the ``wsd`` schedule."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms, embeddings' positions or prototypes —
    decaying prototypes would shrink the reconstruction they must provide)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    eval_interval: int = 100
    """Run validation every N steps (and at the end)."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation (a fixed set, identical across runs)."""
    log_interval: int = 10
    """Write a metrics line every N steps."""
    ckpt_interval: int | None = None
    """Save a checkpoint every N steps (None: at every validation, i.e. every ``eval_interval`` steps;
    0: only at the end). An interrupted run (Ctrl-C, SIGTERM) also saves one at its last completed step."""
    keep_checkpoints: int = 2
    """How many of the most recent checkpoints to keep on disk (older ones are deleted)."""
    seed: int = 1337
    """Seed of initialisation, data order and dropout."""
    device: str = "auto"
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda``, ``cuda:1``…"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Autocast dtype: ``auto`` is bf16 on CUDA, float32 on CPU."""
    compile: bool = False
    """Wrap the model in ``torch.compile`` (GPU runs)."""
    num_threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    trainable: str = "all"
    """Which parameters train: ``all``; ``prototypes`` (only the bank: the backbone and W stay frozen, so
    every logit is exactly the pretrained model's); ``last-N`` (the bank, the last N blocks and the final
    norm); ``lora`` (the bank and the LoRA adapters of ``model.lora_rank``). A retrofit sets it."""
    frozen_steps: int = 0
    """Retrofit stage 1: for the first N optimizer steps only the prototype bank trains (whatever
    ``trainable`` says), starting the head from a pretrained backbone without disturbing it."""
    frozen_from_stored_z: bool = True
    """Retrofit stage 1 (``prism retrofit``; the steps where only the bank trains) runs on stored hidden states:
    the frozen backbone's z over the training split is computed once into ``RUN/stored-z`` (resumable) and the
    bank trains on it in the same batch order, instead of a backbone forward per step (``prismlm.train.
    bank_stage``). Logits are the source model's either way; ``false`` keeps the per-step path (one process
    only uses stored z; under torchrun the per-step path runs)."""
    stage2_from_stored: bool = True
    """Retrofit stage 2 with ``trainable=last-N`` (and ``frozen_from_stored_z``) runs on stored boundary
    activations: the same backbone pass that stores z also stores the residual stream entering block
    n_layer − N, and stage 2 trains the last N blocks, the final norm and the bank on it — a step runs N
    blocks instead of all of them (``prismlm.train.stage2``). Its full-model term is KL to the source model's
    distribution (read from stored z) rather than CE (``stage2_target``). ``false``: the trainer's per-step path
    (CE, the whole backbone every step)."""
    stage2_target: Literal["source", "data"] = "source"
    """What stage 2 on stored activations fits: ``source`` KL(p_src ‖ p) to the source model's distribution
    (a retrofit that keeps the model's predictions and moves the top blocks toward the bank), ``data`` CE on the
    stored next tokens (a fine-tune that learns the corpus, as the per-step path's CE does, at the cost of N
    blocks a step); with ``loss.lambda_proto_kl`` the prototype term's target is then the model's own detached
    prediction, as in the trainer."""
    init_bank: str | None = None
    """Retrofit stage 1 on stored z: start the bank from this file (``prismlm.model.bank_file``: a bank saved
    apart from its model, for the same source model, K and k) instead of seeding it from the stored z; the
    stage continues from the step the file was saved at, with a fresh optimizer (no steps left: the bank is
    the file's, bit for bit). ``prism demo`` starts from the bank it ships. None: seed and train here."""
    stored_z_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """How stored z is kept: float16 (half the bytes; on SmolLM2-135M a bank trained on it moved the residual
    share by 2e-6 and R̄1 by 2e-5 against float32, bench/real_retrofit.py), bfloat16 (for hidden states past
    float16's range, which float16 refuses), float32 (follows the per-step path to rounding)."""
    backbone_lr_ratio: float = 1.0
    """Learning rate of the non-prototype parameters as a fraction of ``lr`` (the bank always uses
    ``lr``): fine-tuning a pretrained backbone wants a smaller step than a fresh prototype bank."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """How a ``torchrun`` job spreads the model over its processes: ``ddp`` (every rank holds the whole
    model and optimizer; gradients are all-reduced) or ``fsdp`` (``fully_shard``: each rank holds 1/world of
    the parameters, gradients and AdamW moments; the optimizer state is checkpointed in per-rank shards).
    The large presets (``gpt2-large``, ``xl-1.6b``) use ``fsdp``. A single process ignores it."""

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)  # JSON gives a list
        check(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas),
            f"train.betas must be two numbers in [0, 1), e.g. train.betas=[0.9,0.95]; got {self.betas!r}",
        )
        check(
            isinstance(self.device, str) and valid_device(self.device),
            f"train.device must be auto, cpu, cuda, cuda:N or another torch device, got {self.device!r}; "
            "e.g. train.device=cpu",
        )
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        check(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        check(self.schedule in ("cosine", "wsd"), f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        check(0 < self.decay_fraction <= 1, f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        check(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        check(
            self.eval_interval >= 1 and self.eval_batches >= 1 and self.log_interval >= 1,
            "eval_interval, eval_batches and log_interval must be >= 1",
        )
        check(
            self.ckpt_interval is None or self.ckpt_interval >= 0,
            f"ckpt_interval must be >= 0 or None, got {self.ckpt_interval}",
        )
        check(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        check(self.dtype in ("auto", "float32", "bfloat16"), f"dtype must be auto/float32/bfloat16, got {self.dtype!r}")
        check(
            self.trainable in ("all", "prototypes", "lora")
            or re.fullmatch(r"last-[1-9]\d*", self.trainable) is not None,
            f"trainable must be all, prototypes, lora or last-N (N >= 1), got {self.trainable!r}",
        )
        check(self.frozen_steps >= 0, f"frozen_steps must be >= 0, got {self.frozen_steps}")
        check(0 < self.backbone_lr_ratio <= 1, f"backbone_lr_ratio must be in (0, 1], got {self.backbone_lr_ratio}")
        check(self.parallel in ("ddp", "fsdp"), f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        check(
            self.stored_z_dtype in ("float16", "bfloat16", "float32"),
            f"stored_z_dtype must be float16, bfloat16 or float32, got {self.stored_z_dtype!r}",
        )
        check(
            self.stage2_target in ("source", "data"),
            f"stage2_target must be 'source' or 'data', got {self.stage2_target!r}",
        )

    def checkpoint_due(self, done: int) -> bool:
        """Whether a periodic checkpoint is due after ``done`` steps (``ckpt_interval``)."""
        every = self.eval_interval if self.ckpt_interval is None else self.ckpt_interval
        return every > 0 and done % every == 0

    def lr_at(self, step: int) -> float:
        """Learning rate at an optimizer step (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        min_lr = self.lr * self.min_lr_ratio
        if self.schedule == "wsd":
            decay_start = int(self.max_steps * (1 - self.decay_fraction))
            if step < decay_start:
                return self.lr
            frac = (step - decay_start) / max(1, self.max_steps - decay_start)
            return self.lr - (self.lr - min_lr) * min(1.0, frac)
        frac = (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps)
        return min_lr + 0.5 * (self.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))
