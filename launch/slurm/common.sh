# Sourced by the sbatch scripts of launch/slurm/ (not run alone): the job's folders, its data
# services, torchrun on every node, requeue. Every setting is an environment variable with a
# default; launch/README.md lists them.
set -euo pipefail
TESSERA_ROOT=${TESSERA_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$TESSERA_ROOT"
source launch/env.sh
: "${SLURM_JOB_ID:?submit this script with sbatch (it reads SLURM_JOB_ID, SLURM_JOB_NODELIST, ...)}"

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_NODE=${HEAD_NODE:-${NODES[0]}}
JOB_DIR=${JOB_DIR:-runs/slurm/${SLURM_JOB_NAME:-tessera}-$SLURM_JOB_ID}   # logs, addresses; the same after a requeue
RUN_DIR=${RUN_DIR:-$JOB_DIR/run}                                          # metrics.jsonl, checkpoints
# Ranks per node: one per GPU the job holds; a CPU job (sbatch --gpus-per-node=0) names it.
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
MAX_RESTARTS=${MAX_RESTARTS:-3}                   # worker-group restarts inside one allocation
RDZV_PORT=${RDZV_PORT:-$(( 29500 + SLURM_JOB_ID % 2000 ))}
SERVICE_REPLICAS=${SERVICE_REPLICAS:-1}           # replicas of each data service, on the first nodes in turn
SERVICE_PORT=${SERVICE_PORT:-0}                   # 0: a free port each (the address file tells the ranks)
METRICS_PORT=${METRICS_PORT:-0}                   # Prometheus /metrics; fixed ports go up by one per replica
SERVICE_START_S=${SERVICE_START_S:-600}           # a large mix may take minutes to open
SERVICE_TLS=${SERVICE_TLS:-1}                     # 1: TLS with a CA of the job's own; 0: bearer token only
mkdir -p "$JOB_DIR/logs"
SERVICE_PIDS=()

log() { echo "[$(date +%H:%M:%S) ${SLURM_JOB_NAME:-tessera} $SLURM_JOB_ID] $*" >&2; }

[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || {
  log "error: no GPUs in this job and no NPROC_PER_NODE: set NPROC_PER_NODE=N (ranks per node) for a CPU job"
  exit 2
}
[[ "$SERVICE_REPLICAS" =~ ^[1-9][0-9]*$ ]] || { log "error: SERVICE_REPLICAS=$SERVICE_REPLICAS must be >= 1"; exit 2; }

# srun answers a SIGTERM by killing its tasks, so the service steps' tasks get the signal from
# scancel instead: each replica drains (NOT_SERVING, open streams end at a message boundary) and
# exits 0. One that is still there after a minute is killed with its srun.
stop_services() {
  [ ${#SERVICE_PIDS[@]} -gt 0 ] || return 0
  local step pid deadline=$(( SECONDS + 60 ))
  for step in $(squeue --steps --noheader --job "$SLURM_JOB_ID" --format=%i,%j 2>/dev/null \
                | awk -F, '$2 ~ /^tessera-data-/ {print $1}'); do
    scancel --signal=TERM "$step" 2>/dev/null || true
  done
  for pid in "${SERVICE_PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  SERVICE_PIDS=()
}

# Sent by SLURM before the time limit (#SBATCH --signal=B:USR1@...): back to the queue; the next
# start continues from the newest complete checkpoint (--auto-resume). Preemption with
# PreemptMode=REQUEUE needs nothing here: SLURM stops the steps and requeues the job itself.
requeue() {
  log "time limit near: requeueing (this start was restart ${SLURM_RESTART_COUNT:-0})"
  scontrol requeue "$SLURM_JOB_ID"
}
trap requeue USR1
trap stop_services EXIT

# The job's secrets in JOB_DIR/secrets (0700), made once, so a requeued start reuses them (its
# checkpoints' resume tokens are signed with the same secret): the resume-token secret (unless
# TESSERA_TOKEN_SECRET is given), the bearer token every rank sends, and with SERVICE_TLS=1 a CA of
# the job that signs each replica's certificate (for its node's names: the address file names its host).
SECRETS=$JOB_DIR/secrets
secret_openssl() { openssl "$@" 2>>"$JOB_DIR/logs/secrets.log"; }
(
  umask 077 && mkdir -p "$SECRETS"
  [ -s "$SECRETS/resume.secret" ] || secret_openssl rand -hex 32 > "$SECRETS/resume.secret"
  [ -s "$SECRETS/data.token" ] || secret_openssl rand -hex 32 > "$SECRETS/data.token"
  if [ "$SERVICE_TLS" = 1 ] && [ ! -s "$SECRETS/ca.pem" ]; then
    secret_openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
      -subj "/CN=tessera-job-$SLURM_JOB_ID" -keyout "$SECRETS/ca.key" -out "$SECRETS/ca.pem" \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
  fi
)
export TESSERA_TOKEN_SECRET=${TESSERA_TOKEN_SECRET:-$(cat "$SECRETS/resume.secret")}
# What every rank needs to read from the job's services (train() passes it on).
DATA_CLIENT_ARGS=(--set data.auth_token_file="$SECRETS/data.token")
[ "$SERVICE_TLS" = 1 ] && DATA_CLIENT_ARGS+=(--set data.tls_ca_file="$SECRETS/ca.pem")
HEALTH_ARGS=()
[ "$SERVICE_TLS" = 1 ] && HEALTH_ARGS=(--tls-ca-file "$SECRETS/ca.pem")

# server_tls NODE: the serve arguments of TLS for a replica on NODE (its certificate made once).
server_tls() {
  [ "$SERVICE_TLS" = 1 ] || return 0
  local node=$1 pem="$SECRETS/server-$1.pem" key="$SECRETS/server-$1.key"
  if [ ! -s "$pem" ]; then
    # The address file names the node by its host name (gethostname), which may differ from NODE.
    local host
    host=$(srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" hostname)
    ( umask 077
      secret_openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$node" \
        -keyout "$key" -out "$SECRETS/server-$node.csr"
      printf 'subjectAltName=DNS:%s,DNS:%s\nextendedKeyUsage=serverAuth\n' "$node" "$host" > "$SECRETS/server-$node.ext"
      secret_openssl x509 -req -in "$SECRETS/server-$node.csr" -CA "$SECRETS/ca.pem" -CAkey "$SECRETS/ca.key" \
        -CAcreateserial -days 30 -extfile "$SECRETS/server-$node.ext" -out "$pem" )
  fi
  echo --tls-cert "$pem" --tls-key "$key"
}

# start_service NAME tessera-data-serve-arguments...: SERVICE_REPLICAS replicas, each a job step of
# its own on the first nodes in turn; sets SERVICE_ADDRESS (HOST:PORT,...) once every one is SERVING.
# Replicas over the same shards send identical streams, and any of them continues another's.
start_service() {
  local name=$1; shift
  local addresses=() files=() i
  for (( i = 0; i < SERVICE_REPLICAS; i++ )); do
    local node=${NODES[i % NNODES]} file="$JOB_DIR/$name-$i.address" metrics=$METRICS_PORT port=$SERVICE_PORT
    (( metrics == 0 )) || metrics=$(( METRICS_PORT + i ))
    (( port == 0 )) || port=$(( SERVICE_PORT + i ))
    rm -f "$file"
    local tls
    read -r -a tls <<< "$(server_tls "$node")"
    srun --overlap --job-name="tessera-data-$name-$i" --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_ON_NODE" \
      --nodelist="$node" --kill-on-bad-exit=1 --output="$JOB_DIR/logs/$name-$i.log" \
      tessera-data serve --host 0.0.0.0 --port "$port" --metrics-port "$metrics" --address-file "$file" \
      --auth-token-file "$SECRETS/data.token" "${tls[@]}" "$@" &
    SERVICE_PIDS+=($!)
    files+=("$file")
  done
  local waited=0
  for (( i = 0; i < SERVICE_REPLICAS; i++ )); do
    until [ -s "${files[i]}" ]; do
      kill -0 "${SERVICE_PIDS[-SERVICE_REPLICAS + i]}" 2>/dev/null \
        || { log "data service '$name' replica $i failed: $(tail -n 3 "$JOB_DIR/logs/$name-$i.log")"; exit 1; }
      (( waited++ < SERVICE_START_S )) || { log "data service '$name' did not start in ${SERVICE_START_S}s"; exit 1; }
      sleep 1
    done
    addresses+=("$(cat "${files[i]}")")
  done
  SERVICE_ADDRESS=$(IFS=,; echo "${addresses[*]}")
  tessera-data health --address "$SERVICE_ADDRESS" "${HEALTH_ARGS[@]}" --wait 60 >&2 || { log "data service '$name' is not SERVING"; exit 1; }
  log "data service '$name' at $SERVICE_ADDRESS (logs $JOB_DIR/logs/$name-*.log)"
}

# train tessera-train-arguments...: one tessera-train per node, each starting torchrun for its
# NPROC_PER_NODE ranks; c10d rendezvous on the head node.
train() {
  local nodes=()
  if [ "$NNODES" -gt 1 ]; then
    nodes=(--nnodes "$NNODES" --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID")
  fi
  log "training on $NNODES node(s) x $NPROC_PER_NODE ranks; run directory $RUN_DIR"
  srun --overlap --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_ON_NODE" --kill-on-bad-exit=0 \
    --output="$JOB_DIR/logs/train-node%n.log" \
    tessera-train --nproc-per-node "$NPROC_PER_NODE" "${nodes[@]}" --max-restarts "$MAX_RESTARTS" --auto-resume \
    --set train.run_dir="$RUN_DIR" --set checkpoint.async_save=true "${DATA_CLIENT_ARGS[@]}" "$@" &
  local pid=$! code=0
  # `wait` returns early when a signal (USR1) arrives: wait again until the step has ended.
  while :; do
    wait "$pid" && code=0 || code=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  log "training ended with exit code $code"
  return "$code"
}
