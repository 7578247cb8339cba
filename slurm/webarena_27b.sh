#!/bin/bash
# ES on Qwen3.5-27B WebArena-Lite, 4xH100 per node: tp=4 inside a node, dp = number of nodes.
# Several nodes: sbatch --nodes=2 slurm/webarena_27b.sh (dp=2; the tp ranks of a group stay on one node).
#   PROFILE=webarena_skill sbatch slurm/webarena_27b.sh         # another profile (default webarena_27b)
#SBATCH --job-name=esopt-webarena-27b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@3600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
source slurm/profile.sh  # sbatch starts the job in the submission directory: the checkout
choose_profile webarena_27b slurm/webarena_27b.sh "$@"
# USR1 an hour before the limit: the trainer stops at the next step boundary (all ranks agree), checkpoints and
# exits 75, and we requeue. The lead must exceed one ES step (8 members x up to 30 turns of 27B rollouts);
# a step cut off by the time limit is only lost work (checkpoint_every=1 + the ledger), but no requeue happens.
export ESOPT_RUNS=${ESOPT_RUNS:-$HOME/esopt_runs}
# every task reads these (esopt_mp/parallel/launcher.py, srun branch): rank SLURM_PROCID of SLURM_NTASKS,
# GPU SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE ranks on its node. srun of Slurm 22.05 (and some later) does not pass
# sbatch's --cpus-per-task to its tasks (one core each, OMP_NUM_THREADS threads on it), hence the explicit one
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}  # the user's value wins
# WA_SHOPPING, WA_SHOPPING_ADMIN, WA_REDDIT, WA_GITLAB, WA_MAP, WA_WIKIPEDIA, WA_HOMEPAGE: the WebArena sites
: "${WA_SHOPPING:?export the WebArena site URLs (WA_*) before sbatch}"
# the interpreter of tools/setup_browser.py --venv .venv-web (BrowserGym; torch and esopt_mp from the system)
PY=${ESOPT_WEB_PYTHON:-.venv-web/bin/python}
# before any GPU work, with the run's own overrides: the offline browser stack, every site the run's task set
# needs and (judged tasks included) the LLM judge; prints one JSON line naming what is missing.
# Browsers per TP leader: env.webarena_lite.max_browsers (8 in the profile).
"$PY" tools/webarena_tasks.py --preflight -- +experiment="$PROFILE" parallel.tp=4 \
  parallel.dp=$SLURM_NNODES "$@" || exit 1
set +e
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" "$PY" launch/train.py +experiment="$PROFILE" \
  parallel.tp=4 "$@"
rc=$?
set -e
if [ $rc -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
exit $rc
