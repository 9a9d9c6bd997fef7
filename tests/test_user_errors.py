"""Issue 23, items 4 and 6: user mistakes that printed a traceback (or ran without end) are one line naming
the option or file and the fix, exit code 2 — and output files are written whole or not at all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prismlm.cli import app
from prismlm.config import RunConfig, TrainConfig
from prismlm.errors import ConfigError

SMALL_DATA = ["--set", "data.max_docs=60", "--set", "data.max_chars_per_doc=4000", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tiny_shards, tmp_path_factory):
    from conftest import train_tiny_run

    return train_tiny_run(tiny_shards, tmp_path_factory.mktemp("user_errors"), steps=4, batch_size=4, warmup_steps=1)[1]


def _run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(res, *expected: str) -> None:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error:"), res.output
    for e in expected:
        assert e in line, (e, line)


# ----- config values: validated in the dataclass, named by their field -------------------------------------
@pytest.mark.parametrize(
    "override, field",
    [
        ("train.device=tpu9", "train.device"),
        ("train.device=cuda:x", "train.device"),
        ("train.betas=0.9", "train.betas"),
        ("train.betas=[0.9]", "train.betas"),
        ("train.betas=[0.9,1.5]", "train.betas"),
        ("train.batch_size=0", "train.batch_size must be >= 1"),  # every field's check names its section
        ("model.prototypes.top_k=0", "model.prototypes.top_k must be in"),
        ("data.val_fraction=2", "data.val_fraction must be in (0, 1)"),
    ],
)
def test_bad_config_values_name_the_field(tmp_path, override, field):
    res = _run("train", "--preset", "tiny", "--set", override, "--out", tmp_path / "r", *SMALL_DATA)
    _one_line_error(res, field)
    assert not (tmp_path / "r").exists()


def test_train_config_validates_device_and_betas_itself():
    with pytest.raises(ConfigError, match="train.device"):
        TrainConfig(device="tpu9")
    with pytest.raises(ConfigError, match="train.betas"):
        TrainConfig(betas=0.9)  # type: ignore[arg-type]
    assert TrainConfig(device="cuda:1", betas=(0.8, 0.99)).device == "cuda:1"  # not checked for presence here
    assert RunConfig.from_dict({"train": {"betas": [0.9, 0.95]}}).train.betas == (0.9, 0.95)


# ----- output paths ---------------------------------------------------------------------------------------
def test_an_out_folder_that_cannot_be_created_is_one_line(tmp_path):
    res = _run(
        "train",
        "--preset",
        "tiny",
        "--out",
        "/proc/prism-no-such-folder/run",
        *SMALL_DATA,
        "--set",
        f"data.data_dir={tmp_path / 'data'}",
    )
    _one_line_error(res, "--out", "/proc/prism-no-such-folder/run")


def test_json_and_html_outputs_create_their_folders(tiny_run, tiny_shards, tmp_path):
    out = tmp_path / "new" / "deeper" / "m.json"
    res = _run("eval", tiny_run, "--batches", "1", "--shards", tiny_shards.root, "--json", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["step"] == 4
    page = tmp_path / "also-new" / "e.html"
    res = _run("explain", tiny_run, "The sea", "--no-index", "--html", page)
    assert res.exit_code == 0, res.output
    assert page.read_text(encoding="utf-8").rstrip().endswith("</html>")


def test_an_output_file_that_cannot_be_written_names_its_option(tiny_run, tmp_path):
    (tmp_path / "taken").mkdir()
    res = _run("explain", tiny_run, "The sea", "--no-index", "--html", tmp_path / "taken")
    _one_line_error(res, "--html", "taken")
    res = _run("explain", tiny_run, "The sea", "--no-index", "--json", "/proc/prism-nowhere/e.json")
    _one_line_error(res, "--json", "/proc/prism-nowhere/e.json")


def test_a_lone_surrogate_is_written_as_a_replacement_character(tiny_run, tiny_shards, tmp_path):
    """`explain --html/--json` and `attribute --json` with undecodable argv bytes in the text: a whole file
    with U+FFFD in their place (before: UnicodeEncodeError and a 0-byte file)."""
    page, data = tmp_path / "e.html", tmp_path / "e.json"
    res = _run("explain", tiny_run, "lone \udcff surrogate", "--no-index", "--html", page, "--json", data)
    assert res.exit_code == 0, res.output
    assert "\ufffd" in page.read_text(encoding="utf-8") and page.read_text().rstrip().endswith("</html>")
    assert json.loads(data.read_text(encoding="utf-8"))["text"] == "lone \ufffd surrogate"
    att = tmp_path / "a.json"
    res = _run(
        "attribute",
        tiny_run,
        "The \udcff sea",
        "--method",
        "full",
        "--max-sequences",
        "8",
        "--top",
        "2",
        "--shards",
        tiny_shards.root,
        "--json",
        att,
    )
    assert res.exit_code == 0, res.output
    assert json.loads(att.read_text(encoding="utf-8"))["prompt"] == "The \ufffd sea"
    assert not list(tmp_path.glob("*.tmp"))


# ----- numeric options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_serve_port_out_of_range_is_refused_before_opening_the_run(tmp_path, port):
    res = _run("serve", tmp_path / "not-even-a-run", "--port", port)
    _one_line_error(res, "--port", "65535")


def test_explain_top_must_be_positive(tiny_run):
    _one_line_error(_run("explain", tiny_run, "x", "--no-index", "--top", "-1"), "--top")


def test_generate_refuses_an_unbounded_token_count(tiny_run, monkeypatch):
    import prismlm.app.operations as operations

    def never(*a, **k):  # the old code started a generation that would run for days
        raise AssertionError("generation started")

    monkeypatch.setattr(operations, "sample_continuations", never)
    _one_line_error(_run("generate", tiny_run, "-n", "1000000000", "--device", "cpu"), "--tokens", "65,536")


# ----- damaged run folders ---------------------------------------------------------------------------------
def test_weights_replaced_by_a_folder_are_named(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    weights = next(run.glob("checkpoints/step-*/model.safetensors"))
    weights.unlink()
    weights.mkdir()
    _one_line_error(_run("generate", run, "-n", "2", "--device", "cpu"), "model.safetensors", "folder")


def test_a_metrics_log_replaced_by_a_folder_is_named(tiny_run, tiny_shards, tmp_path):
    from prismlm.errors import RunError
    from prismlm.train import load_checkpoint, train

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    cfg = load_checkpoint(run).config
    with pytest.raises(RunError, match="metrics.jsonl is a folder"):
        train(cfg, run, shards=tiny_shards, resume=True, extend_to=6, progress=False)


def test_export_into_a_folder_that_cannot_be_written_is_one_line(tiny_run, tmp_path, monkeypatch):
    """A read-only or immutable parent: the OS refuses the staging folder (EACCES / EPERM). Root ignores
    permission bits, so the refusal is the OS's own error raised where the folder is made."""
    pytest.importorskip("transformers")
    import prismlm.artifacts as artifacts

    real_mkdir = Path.mkdir

    def refusing(self, *a, **k):
        if self.name.endswith(".tmp") and self.parent == tmp_path / "ro":
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_mkdir(self, *a, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(artifacts.Path, "mkdir", refusing)
    res = _run("export", tiny_run, tmp_path / "ro" / "exp", "--device", "cpu")
    _one_line_error(res, "OUT", "Operation not permitted")
    assert not (tmp_path / "ro" / "exp").exists()


def test_an_os_error_on_a_path_is_one_line_in_every_command(tiny_run, monkeypatch):
    """The safety net at the CLI boundary: an OSError about a path names the path and a fix."""
    import prismlm.app.operations as operations

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(operations, "sample_continuations", denied)
    _one_line_error(_run("generate", tiny_run, "-n", "1", "--device", "cpu"), "Permission denied", "/some/file")


@pytest.mark.skipif(
    not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0, reason="root ignores permission bits"
)
def test_export_into_a_read_only_folder_is_one_line(tiny_run, tmp_path):
    pytest.importorskip("transformers")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        res = _run("export", tiny_run, ro / "exp", "--device", "cpu")
        _one_line_error(res, "OUT", str(ro / "exp"))
    finally:
        ro.chmod(0o755)
