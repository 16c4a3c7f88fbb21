#!/usr/bin/env bash
# Structured output against unconstrained decoding on a GPU: the structured rows of the
# current-figures table in docs/benchmarks.md (benchmarks/results/h200/structured_output.json).
#
#     benchmarks/gpu/structured_output.sh OUTDIR [RUN ...]
#
# A run is SHAPE:BATCH:GRAMMAR[:FLAGS] (GRAMMAR: a --grammar of step_profile.py; FLAGS, comma
# separated: off = --grammar-on-device off, jf = --jump-forward, req = --window request, which
# times whole requests and is how jump-forward is compared, keys:req against keys:jf,req). Every run
# times its constrained window and then the same requests without a grammar at the constrained
# outputs' lengths (--vs-free), each over REPEATS windows (default 3). Without runs, the table's
# matrix. Writes OUTDIR/<run>.json and .log, and OUTDIR/structured_output.json with every run's
# figures. Set GIT_COMMIT where the tree was copied without its history.
set -u
out=${1:?usage: structured_output.sh OUTDIR [RUN ...]}
shift
mkdir -p "$out"
[ -n "${PHLOEM_SETUP_DONE:-}" ] || source benchmarks/gpu/setup_h200.sh install > /dev/null
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
step="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path ${TOKENIZER:-.gputok}
 --no-torch-profile --input-len 128 --max-new-tokens 128 --vs-free --repeats ${REPEATS:-3}"
runs=${*:-"smollm2-135m:1:record smollm2-135m:1:regex smollm2-135m:1:record:off smollm2-135m:32:record
 smollm2-135m:32:regex smollm2-135m:32:mixed smollm2-135m:32:record:off smollm2-135m:128:record
 smollm2-135m:128:regex smollm2-135m:128:mixed smollm2-135m:1:keys:req smollm2-135m:1:keys:jf,req
 smollm2-135m:32:keys:req smollm2-135m:32:keys:jf,req llama3-8b:1:record llama3-8b:32:record llama3-8b:32:mixed llama3-8b:128:record llama3-8b:128:regex"}
for run in $runs; do
    IFS=: read -r shape batch grammar flags <<< "$run"
    args="--dummy-shape $shape --batch $batch --grammar $grammar"
    case ",${flags:-}," in *,off,*) args="$args --grammar-on-device off" ;; esac
    case ",${flags:-}," in *,jf,*) args="$args --jump-forward" ;; esac
    case ",${flags:-}," in *,req,*) args="$args --window request" ;; esac
    name=${run//:/_}
    $step $args --out "$out/$name.json" > "$out/$name.log" 2>&1 || echo "$run failed (see $out/$name.log)"
done
python3 - "$out" "$commit" <<'PY'
import datetime, glob, json, os, sys

out, commit = sys.argv[1], sys.argv[2]
rows = []
for path in sorted(glob.glob(os.path.join(out, "*_*_*.json"))):
    r = json.load(open(path))
    if "timing" not in r:
        continue
    t, f = r["timing"], r.get("free_timing") or {}
    rows.append({
        "run": os.path.basename(path)[:-5], "command": r["command"], "tok_s": round(t["tok_s"], 1),
        "free_tok_s": round(f.get("tok_s", 0.0), 1), "ratio_to_free": round(r.get("ratio_to_free", 0.0), 3),
        "decode_tokens": t["decode_tokens"], "tokens_per_step": round(t["tokens_per_step"], 2),
        "grammar_rejected": t["grammar_rejected"], "finish_kinds": t["finish_kinds"],
        **({"requests_per_s": round(t["requests_per_s"], 2), "chars_per_s": round(t["chars_per_s"], 1),
            "jump_forward_tokens": t["jump_forward_tokens"]} if "requests_per_s" in t else {}),
    })
    print(f"{rows[-1]['run']:40s} {rows[-1]['tok_s']:>10} vs {rows[-1]['free_tok_s']:>10}  ratio {rows[-1]['ratio_to_free']}")
import torch

device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
json.dump({"git_commit": commit, "date": datetime.date.today().isoformat(), "device": device, "runs": rows},
          open(os.path.join(out, "structured_output.json"), "w"), indent=1)
PY
