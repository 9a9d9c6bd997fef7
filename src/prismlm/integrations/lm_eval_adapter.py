"""``lm-eval`` model adapter: ``prism-lm-eval --model prism --model_args pretrained=RUN[,suppress=FILE]``.

``prism-lm-eval`` is lm-eval's own command line with the ``prism`` model registered (lm-eval reads no entry
points). ``PrismEvalLM`` answers the three request types with the run's interventions applied; its
log-likelihoods are ``prismlm.eval.scoring.loglikelihoods``, so lm-eval's accuracies equal ``prism tasks
eval``'s. ``model_args``, rolling windows and batching: docs/modules.md. ``lm-eval`` is optional
(``pip install prismlm[control]``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any  # create_from_arg_obj only: lm-eval's model_args of any kind, forwarded to __init__

import lm_eval.models  # noqa: F401  lm-eval's own models first: registering into an empty registry would hide them
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from prismlm.artifacts import JSON
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import ConfigError, PrismError
from prismlm.eval.scoring import loglikelihoods
from prismlm.model import Intervention, PrismLM

log = logging.getLogger(__name__)

MODEL_ARGS = ("pretrained", "suppress", "suppress_residual", "batch_size", "device")
"""The ``--model_args`` keys of ``--model prism``."""
PASSED_BY_LM_EVAL = ("max_batch_size", "trust_remote_code")
"""Keys lm-eval's command line adds itself (accepted; ``max_batch_size`` caps ``batch_size=auto``)."""
GEN_OPTIONS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k")
"""The generation options ``generate_until`` understands (``top_p=1`` is accepted as the no-op it is)."""
DEFAULT_BATCH = 32
"""Batch size for ``batch_size=auto`` (no search: the scorer's batches are small)."""
GEN_CHUNK = 16
"""Tokens generated between two checks of the stop strings."""


class LMEvalTokenizer(Tokenizer):
    """Our tokenizer with the Hugging Face attributes lm-eval reads for the results' metadata
    (``tokenizer_eos_token`` …). The end-of-text token plays every role, as in GPT-2: it is the prefix of
    an empty context and of rolling windows (bos), the stop token (eos) and the padding of batches (pad)."""

    @classmethod
    def of(cls, tok: Tokenizer) -> LMEvalTokenizer:
        return tok if isinstance(tok, LMEvalTokenizer) else cls(tok.backend, tok.name, tok.eot_id)

    @property
    def name_or_path(self) -> str:
        return self.name

    @property
    def eos_token_id(self) -> int:
        return self.eot_id

    @property
    def eos_token(self) -> str:
        return self.decode([self.eot_id])

    bos_token_id = eos_token_id
    bos_token = eos_token
    pad_token_id = eos_token_id
    pad_token = eos_token


def _batch_size(batch_size: int | str | None, max_batch_size: int | str | None) -> int:
    """lm-eval's ``batch_size`` (an int, or ``auto``/``auto:N``) → our batch size."""
    if max_batch_size is not None and (not str(max_batch_size).isdigit() or int(max_batch_size) < 1):
        raise ConfigError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    if batch_size is None or str(batch_size).strip().lower().startswith("auto"):
        return min(DEFAULT_BATCH, int(max_batch_size)) if max_batch_size is not None else DEFAULT_BATCH
    s = str(batch_size).strip()
    if not s.isdigit() or int(s) < 1:
        raise ConfigError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}", fix="--batch_size 32")
    return int(s)


def _refuse_unknown_keys(unknown: Iterable[str]) -> None:
    if unknown:
        raise ConfigError(
            f"--model prism: unknown model_args {', '.join(sorted(unknown))}; valid keys are {', '.join(MODEL_ARGS)}",
            fix="--model_args pretrained=RUN,suppress=none",
        )


def _refuse_exported_folder(path: Path) -> None:
    """A ``prism export`` folder (a transformers model, ``config.json`` with ``model_type: prism``) is not a
    run: say which lm-eval model reads it instead of "manifest.json is missing"."""
    try:
        exported = json.loads((path / "config.json").read_text()).get("model_type") is not None
    except (OSError, ValueError, AttributeError):
        return
    if exported:
        raise ConfigError(
            f"--model prism: {path} is a transformers model folder (what `prism export` writes), not a prismlm run",
            fix=f"--model hf --model_args pretrained={path},trust_remote_code=True",
        )


@register_model("prism")
class PrismEvalLM(LM):
    """A PRISM (or dense) checkpoint, or an in-memory model + tokenizer, as an lm-eval ``LM``.

    ``PrismEvalLM(pretrained=RUN, suppress=..., batch_size=..., device=...)`` is what
    ``--model prism --model_args ...`` builds; ``PrismEvalLM(model=m, tokenizer=tok)`` wraps a model in
    memory (as it is: on its device, with whatever interventions the caller holds open, plus ``suppress``
    if that names a file)."""

    def __init__(
        self,
        pretrained: str | None = None,
        *,
        model: PrismLM | None = None,
        tokenizer: Tokenizer | None = None,
        suppress: str | None = "auto",
        suppress_residual: str = "auto",
        batch_size: int | str | None = DEFAULT_BATCH,
        max_batch_size: int | None = None,
        device: str | None = None,
        trust_remote_code: bool | None = None,
        **unknown: object,  # refused: only their names are reported
    ) -> None:
        super().__init__()
        _refuse_unknown_keys(unknown)
        self._bs = _batch_size(batch_size, max_batch_size)
        self.checkpoint_path: Path | None = None
        self.model_sha256: str | None = None
        interventions: tuple[Intervention, ...] = ()
        if model is None:
            if pretrained is None or str(pretrained) == "":
                raise ConfigError(
                    "--model prism needs model_args pretrained=RUN (a run folder or checkpoint)",
                    fix="--model_args pretrained=runs/a",
                )
            from prismlm.app.run import Run

            _refuse_exported_folder(Path(str(pretrained)))
            run = Run.open(
                Path(str(pretrained)),
                device=str(device or "auto"),
                suppress=None if suppress is None else str(suppress),
                suppress_residual=str(suppress_residual),
            )
            model, tokenizer, interventions = run.model, run.tokenizer, run.interventions
            self.checkpoint_path, self.model_sha256 = run.checkpoint.path, run.identity
        else:
            if tokenizer is None:
                raise ConfigError("PrismEvalLM(model=...) needs tokenizer= as well")
            from prismlm.app.run import with_residual_mode
            from prismlm.control.suppress import SuppressionSet

            named_file = suppress is not None and str(suppress).lower() not in ("auto", "none")
            sset = with_residual_mode(SuppressionSet.load(str(suppress)) if named_file else None, suppress_residual)
            if sset is not None:
                sset.check(model)
                interventions = (sset.intervention(),)
            dev = next(model.parameters()).device
            if device is not None and str(device) != "auto" and str(device).split(":")[0] != dev.type:
                raise ConfigError(
                    f"device={device!r}, but the model given is on {dev}", fix="move the model, or leave device out"
                )
        if tokenizer is None:
            raise ConfigError(f"checkpoint {pretrained} has no tokenizer")
        self.model = model.eval()
        self.tok = LMEvalTokenizer.of(tokenizer)
        self.interventions = interventions
        self._device = next(self.model.parameters()).device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> PrismEvalLM:
        """``--model_args a=1,b=2`` plus lm-eval's own ``--batch_size``/``--device`` (``additional_config``):
        a key given in ``model_args`` wins — lm-eval's base class would pass it twice (``TypeError: got
        multiple values``)."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls,
        arg_dict: dict[str, Any],  # Any: each value goes to its own __init__ parameter, which checks it
        additional_config: dict | None = None,
    ) -> PrismEvalLM:
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ----- what lm-eval reads about the model ----------------------------------------------------------------
    @property
    def tokenizer(self) -> LMEvalTokenizer:
        """Read by lm-eval for the results' ``tokenizer_*`` fields."""
        return self.tok

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name.replace("/", "__")

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on."""
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def max_gen_toks(self) -> int:
        """Tokens generated when a request does not say (lm-eval's ``HFLM`` default)."""
        return 256

    @property
    def batch_size(self) -> int:
        return self._bs

    def get_model_info(self) -> dict[str, JSON]:
        """Merged into the results' ``config`` by lm-eval's evaluator."""
        p = next(self.model.parameters())
        return {
            "model_num_parameters": self.model.num_parameters(),
            "model_dtype": str(p.dtype),
            "model_device": str(p.device),
            "model_sha": self.model_sha256 or "",
            "prism_checkpoint": str(self.checkpoint_path) if self.checkpoint_path else None,
            "prism_model": "prism" if self.model.is_prism else "dense",
            "prism_interventions": [repr(i) for i in self.interventions],
        }

    # ----- requests --------------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        args = [tuple(r.args) for r in requests]
        with self.model.intervene(*self.interventions):
            out = loglikelihoods(self.model, self.tok, args, batch_size=self._bs)
        for a, res in zip(args, out):
            self.cache_hook.add_partial("loglikelihood", a, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[int, list[int], list[int]]] = []  # (request, context ids, scored ids)
        for i, r in enumerate(requests):
            (text,) = r.args
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok.encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((i, ctx, cont))
        with self.model.intervene(*self.interventions):
            scores = self._score_tokens([(c, x) for _, c, x in windows])
        totals = [0.0] * len(requests)
        for (i, _, _), (ll, _) in zip(windows, scores):
            totals[i] += ll
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(r.args), total)
        return totals

    @torch.no_grad()
    def _score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) → (Σ log p(continuation | context), greedy?); the sequence is cut
        from the left to block_size + 1 tokens. The token-level twin of ``scoring.loglikelihoods``."""
        T = self.max_length
        full = [(c + x)[-(T + 1) :] for c, x in pairs]
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(full[i]))
        for b in range(0, len(order), self._bs):
            ids = order[b : b + self._bs]
            L = max(len(full[i]) - 1 for i in ids)
            x = torch.full((len(ids), L), self.tok.eot_id, dtype=torch.long)
            for r, i in enumerate(ids):
                x[r, : len(full[i]) - 1] = torch.tensor(full[i][:-1])
            logits = self.model(x.to(self._device)).logits  # (B, L, V)
            for r, i in enumerate(ids):
                n, m = len(pairs[i][1]), len(full[i])
                pos = torch.arange(m - 1 - n, m - 1)
                tgt = torch.tensor(full[i][-n:])
                lp = F.log_softmax(logits[r, pos].double(), dim=-1).cpu()  # (n, V)
                results[i] = (float(lp[torch.arange(n), tgt].sum()), bool((lp.argmax(-1) == tgt).all()))
        return results

    def _gen_options(self, gen_kwargs: object) -> tuple[list[str], int, float, int | None]:
        """A request's generation options → (stop strings, max new tokens, temperature (0: greedy), top_k)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        if gen_kwargs is None:
            gen_kwargs = {}
        if not isinstance(gen_kwargs, dict):
            raise ConfigError(f"generate_until expects generation options as a dict, got {gen_kwargs!r:.80}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None), eos=self.tok.eos_token)
        max_gen = int(kw.pop("max_gen_toks"))
        do_sample = bool(kw.pop("do_sample", False))
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        top_k = kw.pop("top_k", None)
        if kw.get("top_p") is not None and float(kw["top_p"]) >= 1.0:
            kw.pop("top_p")
        if kw:
            raise ConfigError(
                f"--model prism: generation option(s) {', '.join(sorted(kw))} not supported; "
                f"supported: {', '.join(GEN_OPTIONS)}",
                fix="drop them from the task's generation_kwargs or --gen_kwargs",
            )
        if max_gen < 0:
            raise ConfigError(f"max_gen_toks must be >= 0, got {max_gen}")
        if top_k is not None and (not str(top_k).isdigit() or int(top_k) < 1):
            raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
        # do_sample without a temperature samples at 1 (as Hugging Face's generate does); otherwise greedy
        temp = (temperature if temperature > 0 else 1.0) if do_sample else 0.0
        return until, max_gen, temp, (int(top_k) if top_k is not None and do_sample else None)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import postprocess_generated_text

        T = self.max_length
        out: list[str] = [""] * len(requests)
        groups: dict[tuple[int, int, float, int | None], list[tuple[int, list[int], list[str]]]] = defaultdict(list)
        for i, r in enumerate(requests):
            context, gen_kwargs = r.args
            until, max_gen, temp, top_k = self._gen_options(gen_kwargs)
            if max_gen == 0:
                continue
            if max_gen >= T:
                log.warning(
                    "max_gen_toks=%d does not fit the context window (%d): the context keeps its last "
                    "token and generation slides past the window",
                    max_gen,
                    T,
                )
            ids = (self.tok.encode(context) if context else []) or [self.tok.eot_id]
            ids = ids[-max(1, T - max_gen) :]  # room for every new token, as HFLM leaves it
            groups[len(ids), max_gen, temp, top_k].append((i, ids, until))
        with torch.no_grad(), self.model.intervene(*self.interventions):
            for (n0, max_gen, temp, top_k), items in groups.items():
                for b in range(0, len(items), self._bs):
                    batch = items[b : b + self._bs]
                    x = torch.tensor([ids for _, ids, _ in batch], dtype=torch.long, device=self._device)
                    texts = [""] * len(batch)
                    done = 0
                    while done < max_gen:  # in chunks, to stop once every row has met a stop string
                        step = min(GEN_CHUNK, max_gen - done)
                        x = self.model.generate(x, step, temperature=temp, top_tokens=top_k)  # lm-eval spells it top_k
                        done += step
                        texts = [self.tok.decode(row[n0:]) for row in x.tolist()]
                        if all(any(u and u in t for u in until) for t, (_, _, until) in zip(texts, batch)):
                            break
                    for t, (i, _, until) in zip(texts, batch):
                        out[i] = postprocess_generated_text(t, until, None)
        for r, s in zip(requests, out):
            self.cache_hook.add_partial("generate_until", tuple(r.args), s)
        return out


def evaluate_with_lm_eval(
    model: PrismLM,
    tokenizer: Tokenizer,
    task_folders: dict[str, str | Path],
    *,
    split_limit: int | None = None,
    batch_size: int = 32,
) -> dict[str, dict[str, float]]:
    """Run lm-eval's own evaluator on our task folders (built by ``prismlm.eval.tasks``) with an
    in-memory model; returns task → {acc, acc_norm}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folders = sorted({str(Path(f).resolve()) for f in task_folders.values()})
    tm = TaskManager(include_path=folders, include_defaults=False)
    names = [f"prism_{t}" for t in task_folders]
    res = simple_evaluate(
        model=PrismEvalLM(model=model, tokenizer=tokenizer, batch_size=batch_size),
        tasks=names,
        task_manager=tm,
        limit=split_limit,
        bootstrap_iters=0,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    out = {}
    for t in task_folders:
        r = res["results"][f"prism_{t}"]
        out[t] = {"acc": float(r["acc,none"]), "acc_norm": float(r["acc_norm,none"])}
    return out


def with_device(args: list[str]) -> list[str]:
    """lm-eval's command-line arguments, plus ``--device`` for this machine (``cuda:0`` or ``cpu``) when an
    evaluation names none (on the command line or in its ``--config`` YAML): lm-eval's default
    ``cuda:0`` would be written into the results JSON even on a CPU run."""
    if len(args) < 2 or args[0] in ("ls", "validate"):
        return args  # not an evaluation (alone, `run` or any one argument only prints help)
    if any(a == "--device" or a.startswith("--device=") for a in args):
        return args
    for j, a in enumerate(args):  # a --config YAML may set the device itself
        path = (
            a.split("=", 1)[1]
            if a.startswith("--config=")
            else (args[j + 1] if a in ("--config", "-C") and j + 1 < len(args) else None)
        )
        if path is not None:
            try:
                import yaml

                if (yaml.safe_load(Path(path).read_text()) or {}).get("device"):
                    return args
            except Exception:  # lm-eval reports an unreadable config itself
                return args
    from prismlm.train.distributed import resolve_device

    return [*args, "--device", str(resolve_device("auto"))]


HELP_HEADER = """\
prism-lm-eval: lm-eval's command line with the PRISM model type registered: pass --model prism.

  prism-lm-eval --model prism --model_args pretrained=RUN[,suppress=auto|none|FILE][,batch_size=N]
                [,suppress_residual=auto|keep|project|mean|contrast][,device=auto|cpu|cuda:1] --tasks TASKS
                [--include_path FOLDER] [--batch_size N]

  pretrained: a run folder or RUN/checkpoints/step-N; suppress: auto (the checkpoint's suppression.json),
  none or a FILE from `prism concept`; suppress_residual: auto (the set's mode), keep (remove the slices),
  project (also project the residual off the span of the set's prototypes) or mean (off their unit mean
  direction). Every other option and model (e.g. --model hf) works as in lm_eval.
  lm_eval's own options:
"""


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one given), else None."""
    value = None
    for j, a in enumerate(args):
        if a == name and j + 1 < len(args):
            value = args[j + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def check_model_args(args: list[str]) -> None:
    """For ``--model prism``: refuse unknown ``model_args`` keys, a missing ``pretrained`` or one that is not a
    run, on the command line as given — lm-eval itself builds the model only after loading its task index."""
    if _option(args, "--model") != "prism":
        return
    given = lm_utils.simple_parse_args_string(_option(args, "--model_args") or "")
    _refuse_unknown_keys(set(given) - set(MODEL_ARGS) - {"trust_remote_code", "max_batch_size"})
    pretrained = given.get("pretrained")
    if pretrained is None or str(pretrained) == "":
        raise ConfigError(
            "--model prism needs model_args pretrained=RUN (a run folder or checkpoint)",
            fix="--model_args pretrained=runs/a",
        )
    path = Path(str(pretrained))
    if not path.exists():
        raise ConfigError(
            f"--model prism: pretrained={path} does not exist",
            fix="--model_args pretrained=RUN (a folder written by prism train or prism retrofit)",
        )
    _refuse_exported_folder(path)


def main(argv: Sequence[str] | None = None) -> None:
    """``prism-lm-eval ARGS`` (or ``python -m prismlm.integrations.lm_eval_adapter ARGS``): lm-eval's command line
    with ``--model prism`` registered; a ``PrismError`` (bad ``model_args``, missing run) is one line on
    stderr and exit code 2. ``-h``/``--help`` prints how to use ``--model prism`` before lm-eval's help."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(HELP_HEADER, flush=True)
    sys.argv = [sys.argv[0] if sys.argv else "prism-lm-eval", *with_device(args)]
    try:
        check_model_args(args)  # before lm-eval indexes its task files (tens of seconds)
        cli_evaluate()
    except PrismError as e:
        print(f"prism-lm-eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # pragma: no cover
    main()
