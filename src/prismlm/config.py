"""Typed configuration: one dataclass per concern, validated on construction.

Every field is documented where it is declared. ``from_dict`` rejects unknown keys so a typo in a
config file or a CLI override fails loudly instead of silently training the wrong model. Named presets
(``tiny``, ``cpu-small``, ``gpt2-124m``, ``gpt2-medium``, ``gpt2-large``, ``xl-1.6b``) live at the bottom.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from prismlm.errors import ConfigError

T = TypeVar("T")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _valid_device(spec: str) -> bool:
    """``auto`` or a string ``torch.device`` parses (``cpu``, ``cuda:1``, ``mps``); whether that device is
    present is checked when the run starts."""
    if spec == "auto":
        return True
    import torch  # here, not at the top: the config module stays importable without loading torch

    try:
        torch.device(spec)
    except (RuntimeError, ValueError):
        return False
    return True


def from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    """Build a dataclass from a dict, rejecting unknown keys and recursing into nested configs."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        sub = _NESTED.get((cls.__name__, name))
        if sub is not None and value is not None:
            value = from_dict(sub, value, f"{where}.{name}")
        elif isinstance(value, list) and name == "betas":
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:  # "batch_size must be >= 1" → "train.batch_size must be >= 1": the key to fix
        section = where.removeprefix("config.") if where.startswith("config.") else None
        head = re.match(r"(\w+) ", e.message)
        if section is None or head is None or head.group(1) not in known:
            raise
        raise ConfigError(f"{section}.{e.message}", fix=e.fix) from None


@dataclass
class PrototypeConfig:
    """The PRISM prototype head (spec §1.2–1.4)."""

    num_prototypes: int = 512
    """K: number of learned prototypes in the bank P (K × d)."""
    top_k: int = 8
    """k: prototypes kept per token after ReLU(cos); activations are exactly k-sparse or fewer."""
    init_std: float = 0.1
    """Prototype entries start as N(0, init_std²). Why small: AdamW moves each entry by about the
    learning rate per step whatever its scale, so a prototype's *angle* moves ∝ lr/‖p‖. With
    init_std=1 (‖p‖≈√d) the prototypes barely left their random init in 300 cpu-small steps
    (R̄1 0.27, 64 dead); with 0.1 they settled on the data (R̄1 0.98, R2 0.98, residual 0.12) at the
    same validation loss. See docs/results.md."""
    chunk_size: int | None = None
    """Tokens per chunk when computing the (tokens × K) cosine matrix, so memory stays bounded for
    large K: peak extra memory is chunk_size × K floats, never B·T × K. ``None`` (default): chosen from
    the memory available on the device (``prismlm.model.prototypes.auto_chunk_size``: ≤ 1/8 of it, and
    ≤ 2^22 entries on CPU, 2^28 on CUDA). Chunking never changes the result."""

    def __post_init__(self) -> None:
        _check(self.num_prototypes >= 1, f"num_prototypes must be >= 1, got {self.num_prototypes}")
        _check(
            1 <= self.top_k <= self.num_prototypes,
            f"top_k must be in [1, num_prototypes={self.num_prototypes}], got {self.top_k}",
        )
        _check(
            self.chunk_size is None or self.chunk_size >= 1, f"chunk_size must be >= 1 or null, got {self.chunk_size}"
        )
        _check(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")


@dataclass
class ModelConfig:
    """GPT backbone (GPT-2 layout) plus an optional prototype head."""

    vocab_size: int = 8192
    """Vocabulary size V; set from the tokenizer when data is prepared."""
    block_size: int = 128
    """Context length T (maximum sequence length)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Model width d."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs (0 for small-data runs)."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers (GPT-2 does)."""
    tie_weights: bool = True
    """Tie the token embedding and the output head W (GPT-2 does)."""
    prototypes: PrototypeConfig | None = field(default_factory=PrototypeConfig)
    """Prototype head; ``None`` gives the matched dense baseline (same backbone, plain linear head)."""
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    """MLP non-linearity of the built-in GPT: exact GELU, or GPT-2's tanh approximation (``gelu_tanh``) so
    GPT-2 weights load with equal logits (the two differ by ~2e-3 in the logits)."""
    layer_norm_eps: float = 1e-5
    """ε of the built-in GPT's LayerNorms (GPT-2 and PyTorch's default: 1e-5)."""
    lm_head_bias: bool = False
    """The unembedding has a bias b (ℓ = W z + b), as some Hugging Face models do; b is then its own,
    constant slice of every logit's decomposition."""
    backbone: Literal["gpt", "hf"] = "gpt"
    """``gpt``: the built-in GPT-2-layout decoder; ``hf``: a Hugging Face causal LM's base model rebuilt from
    ``hf_config`` (``prism retrofit``), whose final hidden states z feed the prototype head and W."""
    hf_config: dict[str, Any] | None = None
    """With ``backbone="hf"``: the transformers config (``PretrainedConfig.to_dict()``) the backbone is
    rebuilt from; ``n_layer``, ``n_head``, ``n_embd`` and ``vocab_size`` are copied from it."""
    lora_rank: int = 0
    """LoRA adapters (``peft``) of this rank on every ``nn.Linear`` of the backbone, scaled by α/r = 2
    (0: none). Retrofit stage 2 with ``--unfreeze lora`` trains only them and the bank; the adapters' B
    matrices start at zero, so the model starts exactly as the pretrained one."""

    def __post_init__(self) -> None:
        if isinstance(self.prototypes, dict):
            self.prototypes = from_dict(PrototypeConfig, self.prototypes, "model.prototypes")
        _check(
            self.activation in ("gelu", "gelu_tanh"), f"activation must be gelu or gelu_tanh, got {self.activation!r}"
        )
        _check(self.layer_norm_eps > 0, f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        _check(self.backbone in ("gpt", "hf"), f"backbone must be gpt or hf, got {self.backbone!r}")
        _check(
            (self.backbone == "hf") == (self.hf_config is not None),
            "model.hf_config must be given exactly when model.backbone is 'hf'",
        )
        _check(self.lora_rank >= 0, f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.hf_config is not None:
            _check(
                isinstance(self.hf_config, dict) and "model_type" in self.hf_config,
                "model.hf_config must be a transformers config dict with a model_type",
            )
        _check(self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}")
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer}")
        _check(self.n_embd >= 1, f"n_embd must be >= 1, got {self.n_embd}")
        _check(
            self.n_head >= 1 and (self.n_embd % self.n_head == 0 or self.backbone == "hf"),
            f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})",
        )  # an HF backbone has its own head_dim
        _check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def is_prism(self) -> bool:
        return self.prototypes is not None


@dataclass
class LossConfig:
    """Weights of the PRISM objective L = CE + λ_rec REC + λ₁ R1 + λ₂ R2 (spec §2)."""

    lambda_rec: float = 1.0
    """Weight of REC = mean ‖r‖²/‖z‖² (residual energy share)."""
    lambda_r1: float = 0.1
    """Weight of R1 = mean over prototypes of min over batch tokens (1 − cos(p_i, z_t))."""
    lambda_r2: float = 0.1
    """Weight of R2 = mean over tokens of min over prototypes (1 − cos(z_t, p_i))."""
    warmup_steps: int = 0
    """The three prototype weights ramp linearly from 0 to their value over this many optimizer
    steps, so the backbone first learns language before it is pulled onto the prototypes."""

    def __post_init__(self) -> None:
        for name in ("lambda_rec", "lambda_r1", "lambda_r2"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def weights_at(self, step: int) -> dict[str, float]:
        """Loss weights at an optimizer step (warm-up applied); CE always has weight 1."""
        ramp = 1.0 if self.warmup_steps == 0 else min(1.0, (step + 1) / self.warmup_steps)
        return {"ce": 1.0, "rec": self.lambda_rec * ramp, "r1": self.lambda_r1 * ramp, "r2": self.lambda_r2 * ramp}


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
        _check(0.0 < self.val_fraction < 1.0, f"val_fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.shuffle_buffer >= 1, f"shuffle_buffer must be >= 1, got {self.shuffle_buffer}")
        _check(self.stream_val_tokens >= 1, f"stream_val_tokens must be >= 1, got {self.stream_val_tokens}")
        _check(
            not (self.streaming and re.match(r"^bpe(?:[-:]\d+)?$", self.tokenizer)),
            f"data.streaming needs a fixed tokenizer, but data.tokenizer={self.tokenizer!r} must be trained on "
            "the corpus first: use gpt2, hf:NAME or a saved tokenizer folder",
        )
        _check(self.max_docs is None or self.max_docs >= 1, "max_docs must be >= 1")
        _check(self.max_chars_per_doc is None or self.max_chars_per_doc >= 1, "max_chars_per_doc must be >= 1")


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
    norm); ``lora`` (the bank and the LoRA adapters of ``model.lora_rank``). Retrofitting
    (``prism retrofit --unfreeze``) sets it."""
    frozen_steps: int = 0
    """Retrofit stage 1: for the first N optimizer steps only the prototype bank trains (whatever
    ``trainable`` says), starting the head from a pretrained backbone without disturbing it."""
    frozen_from_stored_z: bool = True
    """Retrofit stage 1 (``prism retrofit``; the steps where only the bank trains) runs on stored hidden states:
    the frozen backbone's z over the training split is computed once into ``RUN/stored-z`` (resumable) and the
    bank trains on it in the same batch order, instead of a backbone forward per step (``prismlm.train.
    bank_stage``). Logits are the source model's either way; ``false`` keeps the per-step path (one process
    only uses stored z; under torchrun the per-step path runs)."""
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
        _check(
            isinstance(self.betas, tuple)
            and len(self.betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in self.betas),
            f"train.betas must be two numbers in [0, 1), e.g. --set train.betas=[0.9,0.95]; got {self.betas!r}",
        )
        _check(
            isinstance(self.device, str) and _valid_device(self.device),
            f"train.device must be auto, cpu, cuda, cuda:N or another torch device, got {self.device!r}; "
            "e.g. --set train.device=cpu",
        )
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        _check(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.schedule in ("cosine", "wsd"), f"schedule must be 'cosine' or 'wsd', got {self.schedule!r}")
        _check(0 < self.decay_fraction <= 1, f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _check(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        _check(
            self.eval_interval >= 1 and self.eval_batches >= 1 and self.log_interval >= 1,
            "eval_interval, eval_batches and log_interval must be >= 1",
        )
        _check(
            self.ckpt_interval is None or self.ckpt_interval >= 0,
            f"ckpt_interval must be >= 0 or None, got {self.ckpt_interval}",
        )
        _check(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        _check(
            self.dtype in ("auto", "float32", "bfloat16"), f"dtype must be auto/float32/bfloat16, got {self.dtype!r}"
        )
        _check(
            self.trainable in ("all", "prototypes", "lora")
            or re.fullmatch(r"last-[1-9]\d*", self.trainable) is not None,
            f"trainable must be all, prototypes, lora or last-N (N >= 1), got {self.trainable!r}",
        )
        _check(self.frozen_steps >= 0, f"frozen_steps must be >= 0, got {self.frozen_steps}")
        _check(0 < self.backbone_lr_ratio <= 1, f"backbone_lr_ratio must be in (0, 1], got {self.backbone_lr_ratio}")
        _check(self.parallel in ("ddp", "fsdp"), f"parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        _check(
            self.stored_z_dtype in ("float16", "bfloat16", "float32"),
            f"stored_z_dtype must be float16, bfloat16 or float32, got {self.stored_z_dtype!r}",
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


@dataclass
class AttributionConfig:
    """Options of training-data attribution in prototype space (spec §3.2): the postings cache built by
    ``prismlm.tda.build_cache`` and ``prism attribute-cache``. Recorded in the cache's manifest."""

    r: int | None = None
    """Sketch size per posting (``--r``). None: d (the model width), for which ``identity``,
    ``orthogonal`` and ``pca`` projections give exact scores; smaller r trades accuracy for bytes."""
    projection: Literal["identity", "orthogonal", "gaussian", "pca", "pca-local"] = "orthogonal"
    """The fixed r × d sketch matrix R (``--projection``): ``identity`` (r = d), ``orthogonal`` (random
    orthonormal rows scaled by √(d/r)), ``gaussian`` (JL, N(0, 1/r)), ``pca`` (top-r principal
    directions of the whitened block gradients, fitted on ``pca_sequences`` sequences), or ``pca-local``
    (one such r × d basis per prototype, fitted on that prototype's postings: far better top-k agreement
    at small r, and better the more sequences it is fitted on — at r = 32 on a 12k-sequence corpus, top-10
    overlap with the full method 0.62 fitted on 2,048 of them, 0.74 on all; K·r·d floats stored)."""
    seed: int = 0
    """Seed of the random ``orthogonal``/``gaussian`` projection."""
    pca_sequences: int = 256
    """Training sequences the ``pca``/``pca-local`` projections are fitted on (blocks of ``batch_size``
    spread evenly over the cached sequences)."""
    curvature_mode: Literal["shared", "exact"] = "shared"
    """Block curvature (``--curvature``): ``shared`` (H_i = m_i F + λ_i I, one d × d eigendecomposition)
    or ``exact`` (each diagonal block exactly: K eigendecompositions, K·d² memory)."""
    damping: float = 0.1
    """Relative damping ρ (``--damping``): λ_i = ρ · tr(H_i)/d."""
    curvature_sample: int | None = 1024
    """Training sequences the curvature statistics are taken over (``--curvature-sample``): blocks of
    ``batch_size`` spread evenly over the cached sequences (all of them when there are fewer). None or 0:
    every cached sequence (the behaviour before this option). The statistics are averages (a d × d second
    moment and per-prototype masses), so a sample estimates them at a fraction of a full pass: on the
    K=512 cpu-small run (4,096 sequences of 128 tokens), 1,024 spread sequences gave F within 2.7% and m
    within 7.7% (relative L2/L1) of all 4,096, and the same top-10 of 64 training sequences for 4 queries."""
    max_sequences: int | None = None
    """Cache only the first N training sequences (``--max-sequences``); None: all of them. The curvature
    statistics are taken over (up to ``curvature_sample`` of) the same sequences."""
    batch_size: int = 16
    """Sequences per forward pass (``--batch-size``). Parts built separately and merged must use the
    same value (batches follow a fixed grid of sequence ids)."""
    dtype: Literal["float16", "float32", "float64", "int8", "int4", "int3", "pq"] = "float32"
    """Storage type of the sketches (``--dtype``): ``float16``/``float32``/``float64``, ``int8`` / ``int4``
    / ``int3`` (symmetric, one float16 scale per posting; every entry within scale/2 of its float value;
    int4 packs two entries per byte, int3 eight per three bytes), or ``pq`` (product quantisation: the
    posting's direction as r / ``pq_dims`` one-byte codes into 256-centroid codebooks trained on the cache's
    own postings, its norm as a float16 scale; needs faiss, ``prismlm[search]``). int8 keeps top-10 rankings
    nearly unchanged at a quarter of float32's bytes; on the K=512 cpu-small run, pca-local r=40 ``pq`` took
    22 B/token at top-10 overlap 0.82 with the full method where int4 took 39 at 0.84 (docs/results.md)."""
    pq_dims: int = 4
    """``dtype="pq"``: sketch dimensions per sub-quantizer (``--pq-dims``; must divide r): a posting stores
    r / pq_dims bytes of codes plus a 2-byte norm (4: two bits per dimension)."""
    pq_sample: int = 131072
    """``dtype="pq"``: postings the codebooks are trained on (``--pq-sample``; drawn with ``seed`` from
    all of them; all when there are fewer)."""
    prune: float = 0.0
    """Drop the postings that matter least (``--prune``, in [0, 1); 0 keeps all), as ``prune_by`` says. A
    posting can move a score by at most ‖s_q‖·‖s_j‖, so small-norm postings matter least; pruning trades
    top-k agreement for bytes."""
    prune_by: Literal["list", "unit"] = "list"
    """How ``prune`` picks them (``--prune-by``): ``list`` drops postings whose norm is below ``prune`` × the
    largest norm in the same prototype's list; ``unit`` drops, per unit (sequence or document), its
    smallest-norm postings holding at most ``prune`` of the unit's squared-norm mass (its largest postings
    are kept until they hold ≥ 1 − prune). On the cpu-small run (1,024 sequences, pca-local r=48 float32,
    24 queries): ``unit`` 0.1 kept 63% of the postings at top-10 overlap 0.825 with the full method, where
    ``list`` 0.15 kept 92% for the same overlap (0.85 with all)."""
    aggregate: Literal["sequence", "document"] = "sequence"
    """Unit of attribution (``--aggregate``): ``sequence`` (one posting per training sequence and active
    prototype) or ``document`` (sketches summed over the sequences of a document, so scores are per
    document and exact sums of the sequence scores; a sequence belongs to the document holding its middle
    target token). Fewer postings when documents span many sequences."""
    id_encoding: Literal["int32", "delta"] = "int32"
    """How posting ids are stored (``--id-encoding``): ``int32`` (4 bytes each, the format-1 layout) or
    ``delta`` (the gaps between consecutive ids of a prototype's sorted list in 1 or 2 bytes, larger gaps
    as exceptions; exact, ~1 byte per posting on a dense corpus)."""

    def __post_init__(self) -> None:
        _check(
            self.r is None or (isinstance(self.r, int) and self.r >= 1),
            f"attribution option r (--r) must be a positive integer or None (= d), got {self.r!r}",
        )
        _check(
            self.projection in ("identity", "orthogonal", "gaussian", "pca", "pca-local"),
            f"attribution option projection (--projection) must be identity, orthogonal, gaussian, pca or "
            f"pca-local, got {self.projection!r}",
        )
        _check(isinstance(self.seed, int), f"attribution option seed must be an integer, got {self.seed!r}")
        _check(self.pca_sequences >= 1, f"attribution option pca_sequences must be >= 1, got {self.pca_sequences}")
        _check(
            self.curvature_mode in ("shared", "exact"),
            f"attribution option curvature_mode (--curvature) must be shared or exact, got {self.curvature_mode!r}",
        )
        _check(
            math.isfinite(self.damping) and self.damping >= 0,
            f"attribution option damping (--damping) must be a finite number >= 0, got {self.damping!r}",
        )
        _check(
            self.curvature_sample is None or (isinstance(self.curvature_sample, int) and self.curvature_sample >= 0),
            f"attribution option curvature_sample (--curvature-sample) must be an integer >= 0 or None "
            f"(0/None: all), got {self.curvature_sample!r}",
        )
        _check(
            self.max_sequences is None or self.max_sequences >= 1,
            f"attribution option max_sequences (--max-sequences) must be >= 1 or None (all), "
            f"got {self.max_sequences!r}",
        )
        _check(
            self.batch_size >= 1, f"attribution option batch_size (--batch-size) must be >= 1, got {self.batch_size}"
        )
        _check(
            self.dtype in ("float16", "float32", "float64", "int8", "int4", "int3", "pq"),
            f"attribution option dtype (--dtype) must be float16, float32, float64, int8, int4, int3 or pq, "
            f"got {self.dtype!r}",
        )
        _check(
            isinstance(self.prune, (int, float)) and math.isfinite(self.prune) and 0 <= self.prune < 1,
            f"attribution option prune (--prune) must be a number in [0, 1), got {self.prune!r}",
        )
        _check(
            isinstance(self.pq_dims, int) and self.pq_dims >= 1,
            f"attribution option pq_dims (--pq-dims) must be a positive integer, got {self.pq_dims!r}",
        )
        _check(
            isinstance(self.pq_sample, int) and self.pq_sample >= 256,
            f"attribution option pq_sample (--pq-sample) must be an integer >= 256 (one per centroid), "
            f"got {self.pq_sample!r}",
        )
        _check(
            self.prune_by in ("list", "unit"),
            f"attribution option prune_by (--prune-by) must be list or unit, got {self.prune_by!r}",
        )
        _check(
            self.aggregate in ("sequence", "document"),
            f"attribution option aggregate (--aggregate) must be sequence or document, got {self.aggregate!r}",
        )
        _check(
            self.id_encoding in ("int32", "delta"),
            f"attribution option id_encoding (--id-encoding) must be int32 or delta, got {self.id_encoding!r}",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttributionConfig:
        return from_dict(cls, data, "attribution config")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchConfig:
    """Options of the approximate-search sidecar of an attribution cache (``prismlm.tda.search``): one
    maximum-inner-product index (faiss) per long posting list, whose candidates are rescored exactly.
    Recorded in the sidecar's manifest; the query-time knobs (M, nprobe, ef) are arguments of the query."""

    kind: Literal["ivf", "hnsw"] = "ivf"
    """Index per list: ``ivf`` (faiss IndexIVF, inner-product coarse quantiser; build ∝ list length, query
    ∝ nprobe · list/nlist + nlist) or ``hnsw`` (faiss IndexHNSWFlat; better recall per probe, ~3× the build
    time and 4r + 8·hnsw_m bytes per posting)."""
    min_list: int = 512
    """Lists with at most this many postings get no index: a query scans them exactly (cheap, and an index
    over a short list costs more than it saves). 512 is what ``bench/attribution_scaling.py`` measured."""
    nlist_factor: float = 1.0
    """IVF cells per list: ceil(nlist_factor · √n) for a list of n postings, so that coarse search and one
    cell both cost ~√n."""
    encoding: Literal["cache", "flat", "sq8", "sq4"] = "sq8"
    """How an IVF index stores the vectors it ranks: a faiss IVF index holding a copy — ``flat`` (float32,
    4r bytes), ``sq8`` / ``sq4`` (8/4-bit scalar quantiser, r or r/2 bytes; faiss adds an 8-byte id per
    vector) — or ``cache`` (no copy: each cell lists its postings' 4-byte positions and a probed cell is
    decoded from the cache itself and scored exactly; faiss only trains the cells). Measured on the
    cpu-small run from 10^5 to 10^7 tokens (``bench/attribution_scaling.py``): ``sq8`` 96 bytes per token
    beside the cache's 42, query time ∝ tokens^0.34; ``cache`` 14 bytes per token but ∝ tokens^0.62, no
    faster than the exact scan at 10^7 tokens (its probed postings are gathered row by row, where faiss
    scans its codes contiguously). Only the candidates' *order* depends on it: candidates are rescored
    exactly."""
    hnsw_m: int = 16
    """HNSW graph degree (``kind="hnsw"``)."""
    seed: int = 0
    """Seed of the k-means training sample."""

    def __post_init__(self) -> None:
        _check(self.kind in ("ivf", "hnsw"), f"search option kind must be ivf or hnsw, got {self.kind!r}")
        _check(
            isinstance(self.min_list, int) and self.min_list >= 1,
            f"search option min_list must be an integer >= 1, got {self.min_list!r}",
        )
        _check(
            math.isfinite(self.nlist_factor) and self.nlist_factor > 0,
            f"search option nlist_factor must be a finite number > 0, got {self.nlist_factor!r}",
        )
        _check(
            self.encoding in ("cache", "flat", "sq8", "sq4"),
            f"search option encoding must be cache, flat, sq8 or sq4, got {self.encoding!r}",
        )
        _check(
            isinstance(self.hnsw_m, int) and self.hnsw_m >= 2,
            f"search option hnsw_m must be an integer >= 2, got {self.hnsw_m!r}",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchConfig:
        return from_dict(cls, data, "search config")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunConfig:
    """Everything a training run needs; saved resolved in every run folder."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    preset: str | None = None
    """Name of the preset this config started from (informational)."""
    source: dict[str, Any] | None = None
    """What a retrofit's weights were loaded from, when a file: for a GGUF ``kind``, ``path``, ``sha256``,
    ``quantization``, ``architecture``, ``tensor_types``, ``name`` (``prismlm.model.gguf.SourceInfo``);
    copied into every checkpoint's manifest."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
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

    def to_dict(self) -> dict[str, Any]:
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

    def override(self, dotted: dict[str, Any]) -> RunConfig:
        """Return a copy with ``{"train.lr": 1e-3, "model.prototypes": None}``-style overrides applied."""
        data = self.to_dict()
        for key, value in dotted.items():
            parts = key.split(".")
            node = data
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    if p in node and node[p] is None and p == "prototypes":
                        node[p] = asdict(PrototypeConfig())
                    else:
                        raise ConfigError(f"override {key!r}: {p!r} is not a config section")
                node = node[p]
            if parts[-1] not in node:
                raise ConfigError(f"override {key!r}: unknown key {parts[-1]!r}; valid: {sorted(node)}")
            node[parts[-1]] = value
        return RunConfig.from_dict(data)

    def override_strings(self, pairs: list[str] | tuple[str, ...]) -> RunConfig:
        """``["train.lr=1e-3", "model.prototypes=null"]`` (the CLI's ``--set``) → a validated copy. Each
        value is converted to the declared type of its field (int, float, bool, str, a Literal choice,
        or ``null``/``none`` for an optional field); a value that does not convert raises ``ConfigError``
        naming the key, the value and the type expected."""
        return self.override(parse_overrides(pairs))

    def dense(self) -> RunConfig:
        """The matched dense baseline: same everything, no prototype head."""
        return self.override({"model.prototypes": None})


_NESTED: dict[tuple[str, str], type] = {
    ("RunConfig", "model"): ModelConfig,
    ("RunConfig", "loss"): LossConfig,
    ("RunConfig", "data"): DataConfig,
    ("RunConfig", "train"): TrainConfig,
    ("ModelConfig", "prototypes"): PrototypeConfig,
}


def _preset(model: dict, proto: dict | None, train: dict, data: dict | None = None, loss: dict | None = None) -> dict:
    m = dict(model)
    m["prototypes"] = proto
    return {"model": m, "train": train, "data": data or {}, "loss": loss or {}}


# Why these numbers: `tiny` is the test-suite size (d=32, 2 layers, K=64) that trains in seconds on one
# CPU core; `cpu-small` is the demo (d=128, 4 layers, K=512, k=8), the size at which the loss/coverage
# trade-off was measured on this kind of 2-core machine (shared/notes/objective-tradeoff.md); the GPT-2
# presets follow the GPT-2 family shapes with the paper's prototype banks (K=8,192 at 124M, 16,384 at 1.6B).
PRESETS: dict[str, dict] = {
    "tiny": _preset(
        dict(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32),
        dict(num_prototypes=64, top_k=4),
        dict(batch_size=8, max_steps=50, lr=3e-3, warmup_steps=5, eval_interval=25, eval_batches=2, log_interval=5),
        dict(tokenizer="bpe-512"),
    ),
    "cpu-small": _preset(
        dict(vocab_size=8192, block_size=128, n_layer=4, n_head=4, n_embd=128),
        dict(num_prototypes=512, top_k=8),
        dict(batch_size=16, max_steps=600, lr=3e-3, warmup_steps=50, eval_interval=200, eval_batches=8),
        dict(tokenizer="bpe-8192"),
        dict(lambda_rec=1.0, lambda_r1=0.1, lambda_r2=0.1, warmup_steps=100),
    ),
    "gpt2-124m": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        dict(num_prototypes=8192, top_k=8),
        dict(
            batch_size=16, grad_accum=32, max_steps=20000, lr=6e-4, warmup_steps=700, eval_interval=500, eval_batches=50
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "gpt2-medium": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
        dict(num_prototypes=8192, top_k=8),
        dict(
            batch_size=16,
            grad_accum=32,
            max_steps=40000,
            lr=3e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "gpt2-large": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
        dict(num_prototypes=16384, top_k=8),
        dict(
            batch_size=8,
            grad_accum=64,
            max_steps=60000,
            lr=2.5e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
            parallel="fsdp",
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
    "xl-1.6b": _preset(
        dict(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
        dict(num_prototypes=16384, top_k=8),
        dict(
            batch_size=8,
            grad_accum=64,
            max_steps=100000,
            lr=2e-4,
            warmup_steps=700,
            eval_interval=1000,
            eval_batches=50,
            parallel="fsdp",
        ),
        dict(tokenizer="gpt2"),
        dict(warmup_steps=1000),
    ),
}


def replace(cfg: T, **changes: Any) -> T:
    """``dataclasses.replace`` re-exported for convenience (re-runs validation)."""
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]


def _field_type(dotted: str) -> Any:
    """The declared type of a dotted config key (``train.lr`` → float), or ``None`` if unknown."""
    import typing

    cls: Any = RunConfig
    hint: Any = None
    for part in dotted.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = hints[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        cls = next((a for a in ([hint] + args) if dataclasses.is_dataclass(a)), None)
    return hint


def _convert(key: str, raw: str, hint: Any) -> Any:
    """Convert the string ``raw`` to ``hint`` (a field type), or raise ``ConfigError``."""
    import types
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.strip().lower() in ("null", "none"):
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _convert(key, raw, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"--set {key}={raw!r}: " + "; ".join(errors))
    if origin is Literal:
        if raw in [str(a) for a in args]:
            return next(a for a in args if str(a) == raw)
        raise ConfigError(f"--set {key}={raw!r}: expected one of {list(args)}")
    if dataclasses.is_dataclass(hint):
        if raw.strip().lower() in ("null", "none"):
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--set {key}={raw!r}: expected a JSON object or null") from e
    if hint is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={raw!r}: expected true or false")
    if hint is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError(f"--set {key}={raw!r}: expected an integer") from None
    if hint is float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ConfigError(f"--set {key}={raw!r}: expected a number") from None
        if not math.isfinite(value):
            raise ConfigError(f"--set {key}={raw!r}: expected a finite number")
        return value
    if hint is str:
        return raw
    try:  # lists, dicts and anything else: JSON
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_overrides(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["train.lr=1e-3", "model.prototypes=null"]`` → ``{"train.lr": 0.001, "model.prototypes": None}``,
    each value converted to its field's declared type (see ``RunConfig.override_strings``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        key, raw = (x.strip() for x in pair.split("=", 1))
        hint = _field_type(key)
        if hint is None:  # unknown key: let override() name the valid ones
            out[key] = raw
            continue
        out[key] = _convert(key, raw, hint)
    return out
