#!/usr/bin/env bash
# A one-node SLURM "cluster" on this machine (munged, slurmctld and slurmd on localhost, CPU only),
# to run the sbatch scripts of launch/slurm/ for real before a cluster sees them. Needs root and
# Debian/Ubuntu's slurm-wlm (apt-get install -y slurm-wlm). It writes /etc/slurm/slurm.conf, so
# use it on a throwaway machine or container, never on a cluster node.
#
#   bash launch/slurm/local_cluster.sh start   # write the config, start munged, slurmctld, slurmd
#   bash launch/slurm/local_cluster.sh demo    # tiny data, then pretrain_moe.sbatch (tiny_moe, requeued
#                                              # once by the USR1 path) and finetune_long.sbatch
#                                              # (finetune_tiny); waits, prints each job's end; exit 0
#                                              # when both COMPLETED and the first was requeued
#   bash launch/slurm/local_cluster.sh stop
#
# demo's files: runs/slurm/local/ (data, the fine-tune config), runs/slurm/<job>-<id>/ (logs, run).
# DEMO_NPROC (default 4) ranks per job; the jobs run one after the other (--exclusive).
set -euo pipefail
state=/var/lib/tessera-slurm
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() { echo "local_cluster.sh: error: $*" >&2; exit "${2:-1}"; }

start() {
  command -v slurmctld >/dev/null || die "no slurmctld; apt-get install -y slurm-wlm" 2
  [ "$(id -u)" = 0 ] || die "run as root (it starts munged, slurmctld and slurmd)" 2
  local host cpus mem_mb
  host=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  mkdir -p "$state"/{ctld,d,log} /etc/slurm /run/munge
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=tessera-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
MinJobAge=3600
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  chown munge:munge /run/munge 2>/dev/null || true
  [ -s /etc/munge/munge.key ] || die "no /etc/munge/munge.key (the slurm-wlm package creates it with munge)"
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 1 30); do
    sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && { sinfo; return 0; }
    sleep 1
  done
  die "the node did not come up; see $state/log/"
}

stop() {
  for daemon in slurmd slurmctld; do
    [ -f "$state/$daemon.pid" ] && kill "$(cat "$state/$daemon.pid")" 2>/dev/null || true
  done
}

# job_field ID FIELD: a field of `scontrol show job` (kept for MinJobAge after the job ends).
job_field() { scontrol show job "$1" | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1; }

wait_job() {  # wait_job ID: until the job has ended (a requeued job comes back as PENDING first)
  while :; do
    case "$(job_field "$1" JobState)" in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) return 0 ;;
    esac
    sleep 5
  done
}

report() {  # report ID: state, exit code, restarts, the end of its output, its losses
  local id=$1 out dir
  out=$(job_field "$id" StdOut)
  dir=$(ls -d runs/slurm/*-"$id" 2>/dev/null | head -n 1)
  echo "== job $id ($(job_field "$id" JobName)): $(job_field "$id" JobState), exit code $(job_field "$id" ExitCode), restarts $(job_field "$id" Restarts)"
  echo "-- $out (last lines)"
  tail -n 8 "$out" | sed 's/^/   /'
  if [ -n "$dir" ] && [ -f "$dir/run/metrics.jsonl" ]; then
    python - "$dir/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train = [r for r in rows if "loss" in r]
val = [r for r in rows if "val_loss" in r]
print(f"-- {sys.argv[1]}: steps {train[0]['step']}..{train[-1]['step']} ({len(train)} records), "
      f"loss {train[0]['loss']:.4f} -> {train[-1]['loss']:.4f}"
      + (f", val_loss {val[0]['val_loss']:.4f} -> {val[-1]['val_loss']:.4f}" if val else ""))
PY
  fi
}

demo() {
  sinfo -h >/dev/null 2>&1 || die "no SLURM cluster answers; run: bash launch/slurm/local_cluster.sh start"
  cd "$root"
  source launch/env.sh
  local work=runs/slurm/local nproc=${DEMO_NPROC:-4}
  mkdir -p "$work" runs/slurm   # sbatch writes each job's .out to runs/slurm/
  echo "== tiny datasets in $work/data"
  python - "$work" <<'PY'
import json, random, sys
from pathlib import Path

from dataservice.build import make_corpus

work = Path(sys.argv[1])
(work / "data").mkdir(parents=True, exist_ok=True)
make_corpus(work / "data", 600, seed=7, min_len=32, max_len=1500).replace(work / "data" / "pretrain.jsonl")
words = "model data token stream rank shard batch loss step layer expert context window".split()
rng = random.Random(7)
for split, n in (("sft-train", 160), ("sft-val", 24)):
    with open(work / "data" / f"{split}.jsonl", "w") as f:
        for _ in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(5, 40)))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(5, 60)))})
            f.write(json.dumps({"messages": turns}) + "\n")
PY
  for name in pretrain sft-train sft-val; do
    tessera-data build "$work/data/$name.jsonl" --output "$work/data/$name" --overwrite --quiet
  done
  # The fine-tune recipe on tiny_dense's model, trained at 64 positions and extended 4x by yarn.
  python - "$work/finetune_tiny.toml" <<'PY'
import sys, tomllib
from pathlib import Path

import tomli_w

config = tomllib.loads(Path("launch/configs/tiny_dense.toml").read_text())
recipe = tomllib.loads(Path("launch/configs/finetune_tiny.toml").read_text())
scaling = recipe.pop("model")["rope_scaling"]
scaling["original_max_position_embeddings"] = 64
for section, values in recipe.items():
    config.setdefault(section, {}).update(values)
config["model"]["rope_scaling"] = scaling
Path(sys.argv[1]).write_text(tomli_w.dumps(config))
PY

  echo "== submitting"
  local pre fine
  pre=$(NPROC_PER_NODE=$nproc DATA="$work/data/pretrain" CONFIG=launch/configs/tiny_moe.toml \
    sbatch --parsable --gpus-per-node=0 --nodes=1 --time=30 launch/slurm/pretrain_moe.sbatch \
    --set train.max_steps=30 --set checkpoint.interval=5)
  fine=$(NPROC_PER_NODE=$nproc CONFIG="$work/finetune_tiny.toml" TRAIN_DATA="$work/data/sft-train" \
    VAL_DATA="$work/data/sft-val" \
    sbatch --parsable --gpus-per-node=0 --nodes=1 --time=30 launch/slurm/finetune_long.sbatch)
  echo "pretrain_moe.sbatch: job $pre; finetune_long.sbatch: job $fine"

  # The time-limit path: USR1 to the batch shell (what --signal=B:USR1@300 sends) requeues the job;
  # its next start continues from the newest complete checkpoint.
  local ckpt="runs/slurm/tessera-pretrain-moe-$pre/run/checkpoints/latest"
  local state
  until [ -e "$ckpt" ]; do
    state=$(job_field "$pre" JobState)
    case "$state" in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)
        die "job $pre ended before its first checkpoint: $state" ;;
    esac
    sleep 2
  done
  echo "== job $pre has a checkpoint ($(readlink "$ckpt" || cat "$ckpt")): sending USR1 to its batch shell"
  scancel --signal=USR1 --batch "$pre"
  wait_job "$pre"
  wait_job "$fine"
  report "$pre"
  report "$fine"
  [ "$(job_field "$pre" JobState)" = COMPLETED ] && [ "$(job_field "$fine" JobState)" = COMPLETED ] \
    && [ "$(job_field "$pre" Restarts)" -ge 1 ]
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  demo) demo ;;
  *) die "usage: bash launch/slurm/local_cluster.sh start|demo|stop" 2 ;;
esac
