"""Issue 34 on the retrofit: its bank stage on stored z writes checkpoints and a kill there is continued by
the command the refusal names, to the same weights bit for bit; the run folder's lock is held from stage 1
to the end of stage 2; options that can be checked are checked before the backbone pass, and a late failure
leaves nothing that the same command then refuses."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import tiny_retrofit

from prismlm.app.retrofit import resume_retrofit
from prismlm.artifacts import FileLock
from prismlm.config import RunConfig
from prismlm.errors import ConfigError, PrismError, RunError
from prismlm.train import load_checkpoint, train


@pytest.fixture(scope="module")
def dense_run(tiny_shards, tmp_path_factory):
    """A dense tiny run with dropout (stage 2 draws from the RNG, so its state must survive the resume)."""
    out = tmp_path_factory.mktemp("dense") / "run"
    cfg = RunConfig.from_name("tiny").dense().override({"train.max_steps": 3, "model.dropout": 0.1})
    train(cfg, out, shards=tiny_shards, progress=False)
    return out


def _retrofit(source, out, *extra, unfreeze="last-1", **kw):
    extra = ("train.ckpt_interval=2", "train.keep_checkpoints=10", *extra)
    return tiny_retrofit(source, out, extra, steps=8, frozen=6, unfreeze=unfreeze, **kw)


@pytest.fixture(scope="module")
def whole(dense_run, tmp_path_factory):
    """The uninterrupted two-stage retrofit (6 bank steps on float16 stored z, then 2 joint steps)."""
    return _retrofit(dense_run, tmp_path_factory.mktemp("whole") / "run").run_dir


def _same_run(a, b):
    """Same weights, optimizer state and metrics (timings aside) at the end of both runs."""
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca.path.name == cb.path.name
    sa, sb = ca.model.state_dict(), cb.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = ca.trainer_state()["optimizer"], cb.trainer_state()["optimizer"]
    for k, st in oa["state"].items():
        assert all(torch.equal(v, ob["state"][k][n]) for n, v in st.items() if torch.is_tensor(v)), k

    def lines(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "step_time_s", "elapsed_s")} for r in rows]

    assert lines(a) == lines(b)


def test_the_bank_stage_writes_checkpoints_at_its_interval(whole):
    steps = sorted(p.name for p in (whole / "checkpoints").glob("step-*"))
    assert steps[:3] == ["step-000002", "step-000004", "step-000006"]  # 2 and 4 inside the bank stage


def test_a_kill_in_the_bank_stage_is_continued_by_resume_bit_for_bit(dense_run, whole, tmp_path, monkeypatch):
    """Killed after the bank stage's step-4 checkpoint: the same command is refused naming `resume`, and
    resuming ends at the uninterrupted run's weights, optimizer state and metrics (both stages)."""
    import prismlm.train.bank_stage as bank_module

    real = bank_module.save_stored_stage_checkpoint

    def killed_after_step_4(*args, **kwargs):
        path = real(*args, **kwargs)
        if path.name == "step-000004":
            raise KeyboardInterrupt  # as a kill -9 right after the checkpoint
        return path

    out = tmp_path / "run"
    monkeypatch.setattr(bank_module, "save_stored_stage_checkpoint", killed_after_step_4)
    with pytest.raises(KeyboardInterrupt):
        _retrofit(dense_run, out)
    monkeypatch.setattr(bank_module, "save_stored_stage_checkpoint", real)
    assert load_checkpoint(out).path.name == "step-000004"
    with pytest.raises(RunError, match=r"continue it with `resume`"):
        _retrofit(dense_run, out)
    resume_retrofit(out, device="cpu", progress=False)
    _same_run(out, whole)


def test_the_run_lock_is_held_from_stage_1_to_the_end_of_stage_2(dense_run, tmp_path, monkeypatch):
    """Between the bank stage and stage 2 no other writer may take the run folder (it could wipe it)."""
    import prismlm.train.retrofit as retrofit_module

    real_stage_2 = retrofit_module.train_stage2_stored  # stage 2 on stored boundary activations (last-N)
    seen: list[object] = []

    def stage_2(plan, cfg, **kwargs):
        out_dir = plan.out_dir

        def other_writer():
            try:
                FileLock(out_dir / ".lock", f"run folder {out_dir}").acquire().release()
                seen.append("got the lock")
            except RunError as e:
                seen.append(e)

        t = threading.Thread(target=other_writer)
        t.start()
        t.join()
        return real_stage_2(plan, cfg, **kwargs)

    monkeypatch.setattr(retrofit_module, "train_stage2_stored", stage_2)
    _retrofit(dense_run, tmp_path / "run")
    assert len(seen) == 1 and isinstance(seen[0], RunError) and "being written" in str(seen[0])


def test_unfreeze_past_the_models_blocks_is_refused_before_anything_is_written(dense_run, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"only 2 blocks"):
        _retrofit(dense_run, out, unfreeze="last-999")
    assert not out.exists()


def test_a_late_failure_leaves_nothing_that_the_same_command_refuses(dense_run, whole, tmp_path, monkeypatch):
    """A failure after the z pass and before stage 1's first checkpoint removes config.json, env.json and
    stored-z/ it created; the same command then runs (to the uninterrupted run's weights)."""
    import prismlm.train.bank_stage as bank_module

    real = bank_module.save_stored_stage_checkpoint

    def fails(*args, **kwargs):
        raise RunError("the bank's loss became nan at step 2 of stage 1")

    out = tmp_path / "run"
    monkeypatch.setattr(bank_module, "save_stored_stage_checkpoint", fails)
    with pytest.raises(PrismError, match="nan"):
        _retrofit(dense_run, out)
    assert not out.exists()
    monkeypatch.setattr(bank_module, "save_stored_stage_checkpoint", real)
    _retrofit(dense_run, out)
    _same_run(out, whole)


def test_a_validation_split_shorter_than_a_block_is_refused_before_the_z_pass(dense_run, tmp_path):
    """Issue 34: a demo with too little validation text failed only after the backbone pass, leaving
    config.json, env.json and stored-z/ that the same command then refused."""
    from prismlm.errors import DataError

    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"validation split .* fewer than one block"):
        _retrofit(dense_run, out, "data.max_chars_per_doc=30", "data.max_docs=40")
    assert not out.exists()


def test_an_unknown_override_is_refused_before_the_model_loads(dense_run, tmp_path, monkeypatch):
    import prismlm.app.retrofit as app_retrofit

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(app_retrofit, "load_pretrained", no_load)
    monkeypatch.setattr(app_retrofit, "pretrained_from_run", no_load)  # dense_run is a run folder
    with pytest.raises(ConfigError, match=r"unknown key 'bogus'"):
        _retrofit(dense_run, tmp_path / "run", "train.bogus=1")
    with pytest.raises(ConfigError, match=r"train\.lr"):
        _retrofit(dense_run, tmp_path / "run", "train.lr=fast")
    assert not (tmp_path / "run").exists()
