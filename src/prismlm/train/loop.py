"""The training loop around a ``TrainState``: step (micro-batches, clip, AdamW), log, evaluate, checkpoint.
Invariant: between steps the weights, optimizer, RNG and data position agree, and only there is a
checkpoint taken (periodic, final, or on an interrupt)."""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch

from prismlm.errors import RunError
from prismlm.eval.metrics import evaluate
from prismlm.model import PrismLM
from prismlm.progress import Reporter
from prismlm.train import fsdp
from prismlm.train.checkpoint import RngState, TrainerState, find_checkpoint, save_checkpoint
from prismlm.train.distributed import DistInfo, all_reduce_mean, barrier
from prismlm.train.records import MetricsLog, format_eval_line
from prismlm.train.state import Batches, TrainResult, TrainState, rng_state

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.stream import StreamingData

# what signal.signal returns and takes: a handler function, SIG_DFL/SIG_IGN, or None (not installed from Python)
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Interrupts:
    """Ctrl-C (SIGINT) or SIGTERM while training: the first asks the loop to stop at the end of the current
    step, which then saves a checkpoint there (``requested`` names the signal); a second one stops at once
    (``KeyboardInterrupt`` wherever the loop is). Installed only in the main thread of a single process:
    under torchrun every rank would have to stop at the same step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: str | None = None
        self._previous: dict[int, _Handler] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def install(self) -> None:
        if self.enabled and not self._previous:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


@dataclass(frozen=True)
class Where:
    """Where a run trains: its folder, its process (rank, world) and device, and its data (the validation
    split, the tokenizer and manifest a checkpoint records)."""

    out_dir: Path
    info: DistInfo
    device: torch.device
    data: ShardSet | StreamingData


class TrainLoop:
    """Runs ``state`` from ``start_step`` to ``end_step`` in ``out_dir``: ``fit`` is setup's last step.

    What an interrupt can save: the weights and optimizer after ``completed`` steps and the RNG states right
    after that step (nothing draws from them between steps). ``consistent`` is False while the optimizer
    updates the weights and, for a streamed corpus (its position moves per micro-batch), during the
    micro-batches too."""

    def __init__(
        self,
        state: TrainState,
        where: Where,
        feed: Batches,
        *,
        log: MetricsLog,
        bar: Reporter,
        start_step: int,
        resumed: bool,
    ) -> None:
        self.state, self.out_dir, self.info, self.device = state, where.out_dir, where.info, where.device
        self.data, self.feed, self.log, self.bar = where.data, feed, log, bar
        self.start_step, self.resumed = start_step, resumed
        self.running = False
        self.last_eval: dict[str, float] = {}
        self.completed, self.completed_rng, self.consistent, self.saved_at = (
            start_step,
            rng_state(self.device),
            True,
            -1,
        )
        self.t_last, self.tokens_since = time.perf_counter(), 0

    def fit(self, end_step: int, interrupts: Interrupts) -> TrainResult:
        """Steps ``start_step`` … ``end_step − 1``, then the final checkpoint. A signal stops at a step
        boundary (``KeyboardInterrupt``; the caller then calls ``save_on_interrupt``)."""
        tc, st = self.state.cfg.train, self.state
        st.model.train()
        st.train_mode()
        self.running = True
        interrupts.install()
        for step in range(self.start_step, end_step):
            self.enter_stage(step)
            done = self.train_step(step)
            if tc.checkpoint_due(done) and done != end_step:
                self.checkpoint(done)
                self.saved_at = done
            if interrupts.requested and done != end_step:  # a signal asked to stop: at this step boundary
                raise KeyboardInterrupt(interrupts.requested)
        self.running = False
        interrupts.restore()
        self.bar.close()
        final_step = max(end_step, self.start_step)
        ckpt_path, final_model = self.checkpoint(final_step)
        return TrainResult(
            run_dir=self.out_dir,
            checkpoint=ckpt_path or find_checkpoint(self.out_dir),
            step=final_step,
            metrics=self.last_eval if self.info.is_main else {},
            model=final_model,
        )

    def enter_stage(self, step: int) -> None:
        """Retrofit stage 2: after ``train.frozen_steps`` bank-only steps the backbone joins."""
        st = self.state
        if st.stage == "frozen" and step >= st.cfg.train.frozen_steps:
            st.set_stage("main")
            st.model.transformer.train()
            self.bar.message(f"step {step}: stage 2, training {st.cfg.train.trainable} parameters")

    def train_step(self, step: int) -> int:
        """One optimizer step (``grad_accum`` micro-batches), then its log line and validation. Returns the
        number of completed steps."""
        st, tc = self.state, self.state.cfg.train
        self.consistent = not self.feed.moves_per_micro
        lr = tc.lr_at(step)
        for group in st.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        terms = self.accumulate(step)
        self.check_finite(step, terms["loss"])
        grad_norm = fsdp.full_value(torch.nn.utils.clip_grad_norm_(st.model.parameters(), tc.grad_clip or float("inf")))
        self.consistent = False  # the update below changes the weights and the optimizer state
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        done = step + 1
        self.completed, self.completed_rng, self.consistent = done, rng_state(self.device), True
        due = done % tc.log_interval == 0 or done == tc.max_steps
        shown = self.log_step(done, lr, grad_norm, terms) if due else {}
        self.bar.update(1, **shown)
        # Validation on rank 0 only: every rank would compute the same numbers on the same fixed sample; the
        # other ranks wait at their next gradient all-reduce. A sharded model's forward is a collective (each
        # unit all-gathers its weights), so under FSDP every rank evaluates.
        if (self.info.is_main or st.sharded) and (done % tc.eval_interval == 0 or done == tc.max_steps):
            self.validate(step, done, terms["ce"])
        return done

    def accumulate(self, step: int) -> dict[str, float]:
        """Forward and backward over the step's micro-batches (gradient sync on the last only); the loss terms
        averaged over them (``loss``: the weighted total)."""
        st, tc = self.state, self.state.cfg.train
        assert st.fwd_model is not None
        weights = st.cfg.loss.weights_at(step)
        terms: dict[str, float] = {}
        for micro in range(tc.grad_accum):
            batch = torch.from_numpy(self.feed.batch(step, micro)).to(self.device, non_blocking=True)
            x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
            last_micro = micro == tc.grad_accum - 1
            sync = nullcontext() if (st.ddp is None or last_micro) else st.ddp.no_sync()
            fsdp.set_gradient_sync(st.model, last_micro)
            with sync:
                with st.autocast or nullcontext():
                    out = st.fwd_model(x, y, loss_weights=weights)
                (out.loss / tc.grad_accum).backward()
            for name, value in out.losses.items():
                terms[name] = terms.get(name, 0.0) + float(value.detach()) / tc.grad_accum
            terms["loss"] = terms.get("loss", 0.0) + float(out.loss.detach()) / tc.grad_accum
            self.tokens_since += x.numel() * self.info.world_size
        return terms

    def check_finite(self, step: int, loss: float) -> None:
        """Diverged: stop before the optimizer spreads it; the last good checkpoint stays."""
        if math.isfinite(loss):
            return
        latest = (self.out_dir / "checkpoints" / "latest").exists()
        last = find_checkpoint(self.out_dir) if latest else None
        raise RunError(
            f"the training loss became {loss} at step {step + 1} of {self.out_dir}"
            + (f"; the last good checkpoint is {last}" if last else "; no checkpoint was saved"),
            fix="lower train.lr (or raise train.warmup_steps / lower train.grad_clip) and "
            "resume with `resume`, or start again with `overwrite`",
            param=("resume", "overwrite"),
        )

    def log_step(self, done: int, lr: float, grad_norm: torch.Tensor, terms: dict[str, float]) -> dict[str, float]:
        """A ``metrics.jsonl`` record for step ``done``; returns what the progress bar shows."""
        # (2,): the weighted total (CE + REC + R1 + R2, what is minimised) and the CE alone, the quantity
        # validation reports, both averaged over the ranks
        loss_t, ce_t = all_reduce_mean(
            torch.tensor([terms["loss"], terms["ce"]], device=self.device), self.info
        ).tolist()
        now = time.perf_counter()
        record = {
            "step": done,
            "lr": lr,
            "grad_norm": float(grad_norm),
            **{f"train_{k}": v for k, v in terms.items()},
            "train_loss": float(loss_t),
            "tokens_per_s": self.tokens_since / max(now - self.t_last, 1e-9),
            "epoch": self.feed.epoch_at(done),
        }
        self.t_last, self.tokens_since = now, 0
        self.log.write(record)
        return {
            "ce": ce_t,
            **({"total": loss_t} if self.state.model.is_prism else {}),
            "tokens_per_s": round(record["tokens_per_s"]),
        }

    def validate(self, step: int, done: int, train_ce: float) -> None:
        st, tc = self.state, self.state.cfg.train
        self.last_eval = evaluate(
            st.model,
            self.data.val,
            seq_len=st.cfg.model.block_size,
            batch_size=tc.batch_size,
            max_batches=tc.eval_batches,
            device=self.device,
            autocast=st.autocast,
            loss_weights=st.cfg.loss.weights_at(step),
        )
        st.train_mode()
        if self.info.is_main:
            self.log.write({"step": done, **self.last_eval})
            protos = st.cfg.model.prototypes
            self.bar.message(format_eval_line(done, self.last_eval, train_ce, protos.top_k if protos else None))

    def checkpoint(self, at_step: int, rng: RngState | None = None) -> tuple[Path | None, PrismLM | None]:
        """Save a checkpoint (rank 0 writes it; under FSDP every rank takes part). Returns its folder and the
        model it holds (rank 0; ``None`` elsewhere). ``rng``: the RNG states to record (default: now)."""
        st, info = self.state, self.info
        path = None
        saved_model: PrismLM | None = st.model if info.is_main else None
        shard_dir: Path | None = None
        if st.sharded:  # collectives: consolidate the weights on rank 0, every rank writes its optimizer shard
            saved_model = fsdp.consolidated_model(st.model, info.is_main)
            shard_dir = self.out_dir / "checkpoints" / f"step-{at_step:06d}.sharded.tmp"
            fsdp.save_sharded_optimizer(st.model, st.optimizer, shard_dir, info.is_main)
        position = self.feed.position(at_step)  # a collective for a stream under torchrun
        if info.is_main:
            assert saved_model is not None
            trainer_state: TrainerState = {
                "step": at_step,
                "optimizer": fsdp.SHARDED_DIR if st.sharded else st.optimizer.state_dict(),
                "rng": rng or rng_state(self.device),
                "data": position,
            }
            path = save_checkpoint(
                self.out_dir,
                at_step,
                saved_model,
                st.cfg,
                trainer_state=trainer_state,
                tokenizer=self.data.tokenizer,
                data_manifest=self.data.manifest,
                keep=st.cfg.train.keep_checkpoints,
                sharded=shard_dir,
            )
        barrier(info)
        return path, saved_model

    def save_on_interrupt(self) -> None:
        """After an interrupt: a checkpoint of the last completed step if there is something new and consistent
        to save. A torchrun job's ranks cannot agree on a step here (periodic checkpoints cover it); in the
        middle of an update nothing consistent is left to save."""
        fresh = self.completed > self.start_step or not self.resumed
        if not self.info.enabled and self.consistent and self.saved_at != self.completed and fresh:
            self.checkpoint(self.completed, self.completed_rng)
        has_ckpt = (self.out_dir / "checkpoints" / "latest").exists()
        self.bar.message(
            f"interrupted after step {self.completed}: "
            + (
                f"checkpoint {find_checkpoint(self.out_dir)}; it can be resumed"
                if has_ckpt
                else "no checkpoint was saved"
            )
        )
        self.bar.close(stopped=True)
