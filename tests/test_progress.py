"""Long work reports progress through one callback and then prints nothing; the default is a tqdm bar."""

from __future__ import annotations

import json
import re

import pytest

from prismlm.progress import ProgressEvent, Reporter


def test_reporter_modes(capfd):
    events: list[ProgressEvent] = []
    with Reporter(events.append, "work", 5, unit="seq") as r:
        r.update(2, loss=1.5)
        r.message("halfway")
        r.update(3)
    assert [(e.done, e.message, e.finished) for e in events] == [
        (2, None, False),
        (2, "halfway", False),
        (5, None, False),
        (5, None, True),
    ]
    assert events[-2].info == {"loss": 1.5}  # figures persist until replaced
    assert capfd.readouterr() == ("", "")
    with Reporter(False, "work", 5) as r:
        r.update(5)
        r.message("quiet")
    assert capfd.readouterr() == ("", "")
    with Reporter(True, "work", 5) as r:
        r.update(5)
        r.message("shown")
    out, err = capfd.readouterr()
    assert out == "" and "work" in err and "shown" in err
    with Reporter(events.append, "other", 1, enabled=False) as r:  # e.g. a non-main rank under torchrun
        r.update(1)
    assert events[-1].stage == "work"


def test_prepare_train_index_cache_report_through_the_callback(tiny_shards, tmp_path, capfd):
    from prismlm import RunConfig
    from prismlm.config import AttributionConfig
    from prismlm.data.shards import prepare_shards
    from prismlm.explain import IndexSettings, build_index
    from prismlm.tda import build_cache
    from prismlm.train import load_checkpoint, train

    events: list[ProgressEvent] = []
    prepare_shards(
        "builtin", "bpe-512", tmp_path / "shards", max_docs=12, max_chars_per_doc=2000, show_progress=events.append
    )
    tok = [e for e in events if e.stage.startswith("tokenize")]
    assert tok and tok[-1].finished and tok[-1].done == 12 and tok[-1].info["tokens"] > 0

    events.clear()
    cfg = RunConfig.from_name("tiny").override(
        {
            "train.max_steps": 4,
            "train.eval_interval": 2,
            "train.batch_size": 2,
            "train.warmup_steps": 1,
            "train.log_interval": 1,
        }
    )
    train(cfg, tmp_path / "run", shards=tiny_shards, progress=events.append)
    steps = [e.done for e in events if e.stage == "train" and e.message is None and not e.finished]
    assert steps == [1, 2, 3, 4] and all(e.total == 4 for e in events)
    messages = [e.message for e in events if e.message]
    assert "PRISM model" in messages[0] and sum("val CE" in m for m in messages) == 2
    assert "ce" in events[-1].info and events[-1].finished
    # what is shown is labelled as what it is: the train CE (the quantity val CE measures) and the weighted
    # total loss, each equal to the run's own log record of that step
    records = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rec = {r["step"]: r for r in records if "train_ce" in r}
    val_rec = {r["step"]: r for r in records if "val_loss" in r}
    for e in events:
        if e.stage == "train" and e.message is None and not e.finished:
            r = train_rec[e.done]
            assert e.info["ce"] == pytest.approx(r["train_ce"], rel=1e-6)
            assert e.info["total"] == pytest.approx(r["train_loss"], rel=1e-6) and r["train_loss"] != r["train_ce"]
    for step in (2, 4):
        line = next(m for m in messages if m.startswith(f"step {step}:"))
        assert f"val CE {val_rec[step]['val_loss']:.4f}" in line
        assert f"train CE {train_rec[step]['train_ce']:.4f}" in line

    ckpt = load_checkpoint(tmp_path / "run")
    events.clear()
    build_index(ckpt.model, tiny_shards, IndexSettings(top_n=4, max_sequences=6, batch_size=4), progress=events.append)
    T = cfg.model.block_size
    assert [e.done for e in events if not e.finished] == [4 * T, 6 * T] and events[-1].total == 6 * T

    events.clear()
    build_cache(ckpt.model, tiny_shards, AttributionConfig(r=8, max_sequences=6, batch_size=4), progress=events.append)
    assert [(e.stage, e.done) for e in events if e.finished] == [("curvature", 6), ("postings", 6)]
    assert capfd.readouterr() == ("", ""), "with a callback, nothing is printed"


@pytest.mark.slow  # a subprocess or several processes: .ci/run's `-m slow` pass
@pytest.mark.parametrize("flag", ["--progress", "--no-progress"])
def test_cli_logs_plain_lines_when_not_on_a_terminal(tmp_path, flag):
    """Output captured to a file (not a terminal) or --no-progress: plain log lines, no carriage returns."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prismlm.cli",
            "train",
            "--preset",
            "tiny",
            "--steps",
            "4",
            "--set",
            "train.log_interval=2",
            "--set",
            "train.eval_interval=4",
            "--set",
            "data.max_docs=30",
            "--set",
            "data.max_chars_per_doc=2000",
            "--corpus",
            "builtin",
            "--out",
            str(tmp_path / "run"),
            flag,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PRISM_DATA": str(tmp_path / "data")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr
    assert "\r" not in err
    assert "[tokenize builtin]" in err and "done" in err  # the corpus was prepared in this call
    assert "[train] 2/4 step | ce" in err and "[train] 4/4 step | ce" in err and " total " in err
    assert "step 4: val CE" in err and "train CE" in err and "PRISM model" in err
    assert re.search(r"\[train\] 2/4 step \| .* \| \d+:\d\d elapsed, ETA \d+:\d\d$", err, re.M), err


def test_plain_lines_carry_the_elapsed_time_and_an_eta(capfd, monkeypatch):
    """A log line says how long the stage has run and, at the rate since its start, how long it still needs."""
    from prismlm.cli import console as console_mod
    from prismlm.cli.console import PlainProgress

    now = {"t": 100.0}
    monkeypatch.setattr(console_mod.time, "monotonic", lambda: now["t"])
    plain = PlainProgress()
    r = Reporter(plain, "train", 100, unit="step", initial=40)  # a resumed run: 40 steps done before
    r.message("start")
    now["t"] += 30.0
    r.update(6, ce=3.5)  # 6 steps in 30 s: 54 left take 270 s
    now["t"] += 3600.0
    r.update(54, ce=3.0)
    r.close()
    err = capfd.readouterr().err
    assert "[train] 46/100 step | ce 3.5000 | 0:30 elapsed, ETA 4:30" in err
    assert "[train] 100/100 step | ce 3.0000 | 1:00:30 elapsed, ETA 0:00" in err
    assert "[train] 100/100 step done | ce 3.0000 | 1:00:30 elapsed\n" in err


def test_a_stage_left_by_an_exception_ends_stopped(capfd):
    """An interrupt inside a stage ends it with ``stopped`` (the plain log says "stopped", not "done")."""
    from prismlm.cli.console import PlainProgress

    events: list[ProgressEvent] = []
    with pytest.raises(KeyboardInterrupt), Reporter(events.append, "postings", 10, unit="seq") as r:
        r.update(3)
        raise KeyboardInterrupt
    assert events[-1].finished and events[-1].stopped and events[-1].done == 3
    with Reporter(events.append, "postings", 1) as r:
        r.update(1)
    assert events[-1].finished and not events[-1].stopped
    plain = PlainProgress()
    with pytest.raises(KeyboardInterrupt), Reporter(plain, "postings", 10, unit="seq") as r:
        r.update(4)
        raise KeyboardInterrupt
    _, err = capfd.readouterr()
    assert "[postings] 4/10 seq stopped" in err and "done" not in err
