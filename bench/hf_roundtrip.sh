#!/usr/bin/env bash
# A ~1B Llama-shaped Hugging Face checkpoint (Llama 3.2 1B's shape, random weights built by
# transformers, no download) imported, trained 30 steps on this machine's GPU, exported back and
# loaded by transformers: wall time and peak RSS of each conversion. Run from the repository root:
#   bash bench/hf_roundtrip.sh
set -e
W=/tmp/hf1b; rm -rf $W; mkdir -p $W
python - <<'PY'
import torch, transformers
from bench.convert import LLAMA_1B
cfg = transformers.LlamaConfig(num_hidden_layers=16, **LLAMA_1B)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained("/tmp/hf1b/hf")
print("hf params", sum(p.numel() for p in model.parameters()))
PY
du -sh $W/hf
/usr/bin/time -f "from-hf: %e s wall, peak RSS %M KB" python -m interop.cli from-hf $W/hf $W/imp 2>&1 | tail -3
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
python -m dataservice.cli build $stdlib --glob '**/*.py' -o $W/ds -q 2>&1 | tail -1
python -m core.train.cli --config $W/imp/config.toml --set data.dataset=$W/ds --set train.run_dir=$W/run --set train.max_steps=30 --set train.seq_len=4096 --set train.micro_batch_size=2 --set train.global_batch_size=8 --set train.warmup_steps=5 --set train.lr=1e-4 --set train.log_interval=5 --set train.plot=false 2>&1 | grep -v Warning | grep -E "step|checkpoint|error" | tail -9
/usr/bin/time -f "to-hf: %e s wall, peak RSS %M KB" python -m interop.cli to-hf $W/run $W/out 2>&1 | tail -3
python - <<'PY'
import json, torch, transformers
m, info = transformers.AutoModelForCausalLM.from_pretrained("/tmp/hf1b/out", output_loading_info=True, torch_dtype=torch.bfloat16)
print("export loads:", {k: len(v) for k, v in info.items()})
recs = [json.loads(l) for l in open("/tmp/hf1b/run/metrics.jsonl")]
print("loss first", recs[0]["loss"], "last", recs[-1]["loss"], "mfu last", recs[-1]["mfu"], "tok/s", recs[-1]["tokens_per_s"])
PY
