#!/bin/bash
# ES on Qwen3.5-4B Sudoku, one node, 4 GPUs: dp=4 x tp=1 (parallel.dp=auto: every task a dp group).
#   sbatch slurm/sudoku_4b.sh                                   # the H*=5 profile (+experiment=sudoku_4b)
#   PROFILE=sudoku_4b_h10 sbatch slurm/sudoku_4b.sh             # H*=10 (30 turns), or sudoku_4b_h15
#   sbatch --nodes=2 slurm/sudoku_4b.sh model.path=/models/Qwen3.5-4B   # more overrides after the script
# sbatch --export passes PROFILE too: sbatch --export=ALL,PROFILE=sudoku_4b_h15 slurm/sudoku_4b.sh
#SBATCH --job-name=esopt-sudoku-4b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=USR1@180          # 3 min before the limit: finish the step, checkpoint, exit 75
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
source slurm/profile.sh  # sbatch starts the job in the submission directory: the checkout
choose_profile sudoku_4b slurm/sudoku_4b.sh "$@"
export ESOPT_RUNS=${ESOPT_RUNS:-$HOME/esopt_runs}         # shared storage: checkpoints + ledger survive requeue
# every task reads these (esopt_mp/parallel/launcher.py, srun branch): rank SLURM_PROCID of SLURM_NTASKS,
# GPU SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE ranks on its node. srun of Slurm 22.05 (and some later) does not pass
# sbatch's --cpus-per-task to its tasks (one core each, OMP_NUM_THREADS threads on it), hence the explicit one
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}  # the user's value wins
set +e
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" python launch/train.py +experiment="$PROFILE" \
  parallel.tp=1 "$@"
rc=$?
set -e
if [ $rc -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi   # resumes from run.dir on restart
exit $rc
